"""Tensor parallelism is exact: a 2-rank group (gloo over loopback, ranks as threads) against
transformers, token for token, through chunked prefill, prefix-cache hits, swapping, forks with
copy-on-write, n > 1, beam search, preemption by recompute and by swap, and speculative verification.

The all-reduce sums partial products in another order than one matmul does, so logits are
compared with a tolerance and greedy tokens exactly.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.wire import SamplingParams
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from scheduler_svc.sched.speculation import SpeculativeConfig
from testing.executor_plans import (
    PlanDriver,
    check_fork_with_copy_on_write,
    check_prefix_hit,
    check_swap_round_trip,
    hf_greedy,
    hf_logits,
    serve_requests,
)
from testing.plan_driver import GREEDY
from testing.speculative_serving import OracleProposer, serve
from testing.tp_harness import tp_runner

REL_TOL = 1e-4
# (arch, num_key_value_heads override): 8 q heads; 4 KV heads split 2/2, or 1 KV head replicated.
MODELS = {"llama": ("llama", None), "mistral": ("mistral", None), "qwen2": ("qwen2", None),
          "llama-1kv": ("llama", 1)}


def _hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompt(n: int, offset: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(2000 + n + offset)
    return torch.randint(1, 500, (n,), generator=g).tolist()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=list(MODELS))
def model(request, tiny_checkpoint):
    arch, kv = MODELS[request.param]
    path = tiny_checkpoint(arch, "tp", **({} if kv is None else {"num_key_value_heads": kv}))
    return request.param, path, _hf(path)


@pytest.fixture(scope="module")
def llama(tiny_checkpoint):
    path = tiny_checkpoint("llama", "tp")
    return path, _hf(path)


def test_each_rank_holds_half_the_heads(model):
    name, path, _ = model
    with tp_runner(path) as runner:
        for r in [runner, *runner.followers]:
            cfg = r.model.cfg
            assert cfg.num_heads == 4 and cfg.intermediate_size == 128
            assert cfg.num_kv_heads == (1 if name == "llama-1kv" else 2)
            assert r.kv.layers[0][0].shape[2] == cfg.num_kv_heads  # each rank caches its own KV heads
        assert runner.model.lm_head is not None or runner.model.cfg.tie_word_embeddings
        assert all(f.model.lm_head is None for f in runner.followers)  # rank 0 alone samples


def test_greedy_and_logits_match_transformers_with_chunked_prefill(model):
    _, path, hf = model
    with tp_runner(path) as runner:
        runner.keep_logits = True
        drv = PlanDriver(runner)
        first = _prompt(21)
        drv.add(0, first)
        logits = []
        for _ in range(6):
            drv.step({0: 64})
            logits.append(runner.last_logits[0])
        ref = hf_logits(hf, drv.seqs[0].tokens)[len(first) - 1: -1]
        assert _rel_err(torch.stack(logits), ref) < REL_TOL
        # More sequences join in prefill chunks of 7 while sequence 0 decodes.
        prompts = {sid: _prompt(n, sid) for sid, n in ((1, 3), (2, 17), (3, 40))}
        for sid, p in prompts.items():
            drv.add(sid, p)
        drv.run_until(12, chunk=7)
        assert drv.seqs[0].outputs == hf_greedy(hf, first, 12)
        for sid, p in prompts.items():
            assert drv.seqs[sid].outputs == hf_greedy(hf, p, 12), sid


def test_prefix_cache_hit_reads_every_rank_s_cached_blocks(llama):
    path, hf = llama
    with tp_runner(path) as runner:  # seq 1's two full blocks, computed on both ranks, serve seq 2
        check_prefix_hit(runner, hf, _prompt(40, 3), _prompt(9, 4))


def test_swap_out_and_in_moves_each_rank_s_shard(llama):
    path, hf = llama
    with tp_runner(path) as runner:  # every rank's device blocks are overwritten while swapped out
        check_swap_round_trip(runner, hf, _prompt(37, 5), [r.kv for r in [runner, *runner.followers]],
                              runner.settle)


def test_fork_appended_tokens_and_copy_on_write(llama):
    path, hf = llama
    with tp_runner(path) as runner:
        check_fork_with_copy_on_write(runner, hf, _prompt(20, 6), steps=5)
        runner.settle()  # the followers appended exactly what the leader did, and hold the same tables
        for f in runner.followers:
            assert {k: (s.token_ids, s.block_ids) for k, s in f.seqs.items()} == \
                   {k: (s.token_ids, s.block_ids) for k, s in runner.seqs.items()}


def _scheduler(num_blocks: int, mode: str = "recompute", num_cpu: int = 32) -> Scheduler:
    cfg = SchedulerConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=48, max_model_len=256,
                          preemption_mode=mode)
    return Scheduler(cfg, num_blocks, num_cpu, eos_token_ids=())


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_outputs_exact(llama, mode):
    path, hf = llama
    prompts = {f"r{i}": _prompt(n, i) for i, n in enumerate([21, 30, 17, 26])}
    params = RequestParams(max_tokens=24, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    with tp_runner(path, num_blocks=8, num_cpu_blocks=32) as runner:
        sched = _scheduler(8, mode)
        swaps: list[int] = []
        out = serve_requests(runner, sched, {rid: GenerationRequest(rid, p, params) for rid, p in prompts.items()},
                             swaps)
    assert sched.num_preemptions > 0 and (sum(swaps) > 0) == (mode == "swap")
    for rid, p in prompts.items():
        assert out[rid] == [hf_greedy(hf, p, 24)], rid


def test_parallel_sampling_and_beam_search(llama):
    path, hf = llama
    prompt = _prompt(18, 7)
    with tp_runner(path) as runner:
        greedy_n = RequestParams(max_tokens=10, sampling=SamplingParams(temperature=0.0), n=3, ignore_eos=True)
        beams = RequestParams(max_tokens=10, sampling=SamplingParams(temperature=0.0), beam_width=3,
                              early_stopping=False)
        out = serve_requests(runner, _scheduler(64), {"n": GenerationRequest("n", prompt, greedy_n),
                                                      "beam": GenerationRequest("beam", prompt, beams)})
    assert out["n"] == [hf_greedy(hf, prompt, 10)] * 3  # the choices forked from one prefill
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                          early_stopping=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    assert out["beam"] == ref[:, len(prompt):].tolist()


def test_four_ranks_with_a_replicated_kv_head(tiny_checkpoint):
    path = tiny_checkpoint("llama", "tp", num_key_value_heads=1)
    hf = _hf(path)
    with tp_runner(path, world=4) as runner:
        assert [r.model.cfg.num_heads for r in [runner, *runner.followers]] == [2] * 4
        drv = PlanDriver(runner)
        prompts = {sid: _prompt(n, 9 + sid) for sid, n in ((0, 9), (1, 26))}
        for sid, p in prompts.items():
            drv.add(sid, p, GREEDY)
        drv.run_until(8, chunk=10)
    for sid, p in prompts.items():
        assert drv.seqs[sid].outputs == hf_greedy(hf, p, 8)


def test_speculative_verification_keeps_every_rank_on_the_leader_s_tokens(llama):
    """n-gram proposals verified by a 2-rank group: rank 0 verifies, and each follower takes back the
    same rejected proposals (its next steps' K/V shard depends on it). Greedy outputs equal
    transformers', through whole acceptances, bonus tokens and rejections midway."""
    path, hf = llama
    prompts = {f"r{i}": _prompt(n, 30 + i) for i, n in enumerate([15, 22])}
    want = {rid: [hf_greedy(hf, p, 16)] for rid, p in prompts.items()}
    params = RequestParams(max_tokens=16, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
    with tp_runner(path) as runner:
        served = serve(runner, params, SpeculativeConfig(num_speculative_tokens=4), prompts, num_cpu_blocks=16,
                       proposer=OracleProposer(prompts, want, 4))
        runner.settle()
        assert all(not f.seqs for f in runner.followers)
    assert served.outputs == want
    st = served.sched.spec.counters
    assert st.num_drafts < st.num_accepted_tokens < st.num_draft_tokens
