"""Beam search on the real tiny model equals transformers' beam search, token for token.

The real Scheduler (forks, copy-on-write of shared partial blocks, pruned beams
freed at once) drives the real ModelRunner; the reference is
``generate(num_beams=w, num_return_sequences=w, do_sample=False,
early_stopping=False)`` on the same checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_svc.model import load_model
from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.wire import SamplingParams
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing.executor_plans import drive, hf_greedy, make_runner

PROMPTS = [[5, 17, 99, 3, 250, 31, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57]]
MAX_NEW = 12


@pytest.fixture(scope="module")
def models(tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return load_model(tiny_llama_dir), hf


def _hf_beams(hf, prompt, width, eos, length_penalty) -> list[list[int]]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                          do_sample=False, early_stopping=False, max_new_tokens=MAX_NEW,
                          length_penalty=length_penalty, eos_token_id=eos,
                          pad_token_id=eos if eos is not None else 0)
    beams = []
    for row in out[:, len(prompt):].tolist():
        if eos is not None and eos in row:
            row = row[:row.index(eos) + 1]
        beams.append(row)
    return beams


def _our_beams(tiny_llama_dir, model, prompt, width, eos, length_penalty, num_blocks=64):
    runner = make_runner(tiny_llama_dir, num_blocks=num_blocks, num_cpu_blocks=16, model=model)
    cfg = SchedulerConfig(block_size=16, max_num_seqs=16, max_num_batched_tokens=64, max_model_len=256)
    sched = Scheduler(cfg, num_blocks, 16, eos_token_ids=() if eos is None else (eos,))
    params = RequestParams(max_tokens=MAX_NEW, sampling=SamplingParams(temperature=0.0), beam_width=width,
                           length_penalty=length_penalty, early_stopping=False)
    sched.add_request(GenerationRequest("beam", list(prompt), params))
    choices: dict[int, list[int]] = {}
    max_shared = 0

    def take(plan, result) -> None:
        nonlocal max_shared
        assert result.error is None, result.error
        max_shared = max(max_shared, sched.num_shared_blocks)
        for upd in sched.update(result):
            for s in upd.seqs:
                choices.setdefault(s.index, []).extend(s.new_token_ids)
        sched.check_integrity()

    drive(runner, sched, take, max_steps=500)
    assert sched.num_used_blocks == 0
    return [choices[i] for i in range(width)], max_shared


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("prompt_index", [0, 1])
def test_beam_search_equals_transformers_without_eos(tiny_llama_dir, models, width, prompt_index):
    model, hf = models
    prompt = PROMPTS[prompt_index]
    ours, max_shared = _our_beams(tiny_llama_dir, model, prompt, width, None, 1.0)
    assert ours == _hf_beams(hf, prompt, width, None, 1.0)
    assert max_shared > 0  # beams shared their history's blocks instead of copying them


@pytest.mark.parametrize("width,length_penalty", [(2, 1.0), (4, 1.0), (4, 0.5)])
def test_beam_search_equals_transformers_when_eos_is_reached(tiny_llama_dir, models, width, length_penalty):
    model, hf = models
    prompt = PROMPTS[0]
    # Make a token the model produces early on the end-of-sequence token, so beams do finish.
    eos = hf_greedy(hf, prompt, 4)[3]
    theirs = _hf_beams(hf, prompt, width, eos, length_penalty)
    assert any(b and b[-1] == eos for b in theirs), "the scenario must reach EOS"
    ours, _ = _our_beams(tiny_llama_dir, model, prompt, width, eos, length_penalty)
    assert ours == theirs
