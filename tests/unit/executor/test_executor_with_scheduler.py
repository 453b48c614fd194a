"""The real Scheduler driving the real ModelRunner (no transport): preemption keeps outputs exact."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_svc.model import load_model
from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.wire import SamplingParams
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing.executor_plans import hf_greedy, make_runner, serve_requests


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(11)
    return {f"r{i}": torch.randint(1, 500, (n,), generator=g).tolist() for i, n in enumerate([21, 30, 17, 26])}


@pytest.fixture(scope="module")
def setup(tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return load_model(tiny_llama_dir), hf


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_greedy_outputs_exact(tiny_llama_dir, setup, mode):
    model, hf = setup
    num_blocks, max_tokens = 8, 24  # 4 requests of ~50 tokens each cannot all fit in 8 x 16 slots
    runner = make_runner(tiny_llama_dir, num_blocks=num_blocks, num_cpu_blocks=32, model=model)
    cfg = SchedulerConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=48, max_model_len=256,
                          preemption_mode=mode)
    sched = Scheduler(cfg, num_blocks, 32, eos_token_ids=())
    params = RequestParams(max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    prompts = _prompts()
    reqs = {rid: GenerationRequest(rid, p, params) for rid, p in prompts.items()}
    swaps: list[int] = []
    out = serve_requests(runner, sched, reqs, swaps)
    assert sched.num_preemptions > 0
    assert (sum(swaps) > 0) == (mode == "swap")
    for rid, p in prompts.items():
        assert out[rid] == [hf_greedy(hf, p, max_tokens)], rid


def test_parallel_sampling_choices_match_their_seeds_alone(tiny_llama_dir, setup):
    model, _ = setup
    prompt = _prompts()["r1"]
    sampling = SamplingParams(temperature=1.0, top_k=50, seed=77)

    def serve(n: int) -> list[list[int]]:
        runner = make_runner(tiny_llama_dir, num_blocks=32, model=model)
        sched = Scheduler(SchedulerConfig(block_size=16, max_model_len=256), 32, 8, eos_token_ids=())
        params = RequestParams(max_tokens=10, sampling=sampling, n=n, ignore_eos=True)
        return serve_requests(runner, sched, {"a": GenerationRequest("a", prompt, params)})["a"]

    both = serve(2)
    assert len(both) == 2 and both[0] != both[1]
    assert serve(1)[0] == both[0]  # choice 0 uses seed 77 whether or not it was forked
