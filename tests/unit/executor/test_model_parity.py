"""Our torch model through the runner versus transformers' own forward/generate (float32)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_svc.model import load_model
from testing.executor_plans import (
    PlanDriver,
    check_fork_with_copy_on_write,
    check_prefix_hit,
    check_swap_round_trip,
    hf_greedy,
    hf_logits,
    make_runner,
)

REL_TOL = 1e-4


def _hf(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _prompt(n: int, offset: int = 0, vocab: int = 500) -> list[int]:
    g = torch.Generator().manual_seed(1000 + n + offset)
    return torch.randint(1, vocab, (n,), generator=g).tolist()


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.fixture(scope="module", params=["llama", "qwen2", "mistral"])
def arch_setup(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param, "small")
    return request.param, path, load_model(path), _hf(path)


def test_config_shapes_cover_the_variants(tiny_llama_dir, tiny_qwen2_dir):
    llama, qwen = load_model(tiny_llama_dir).cfg, load_model(tiny_qwen2_dir).cfg
    assert llama.num_kv_heads < llama.num_heads and not llama.tie_word_embeddings
    assert qwen.qkv_bias and qwen.tie_word_embeddings


# Both CPU attention backends: the fused kernel (served by default) and the torch reference.
@pytest.mark.parametrize("cpu_attention", ["fused", "torch"])
def test_one_sequence_greedy_and_logits(arch_setup, cpu_attention):
    _, path, model, hf = arch_setup
    runner = make_runner(path, model=model, cpu_attention=cpu_attention)
    runner.keep_logits = True
    drv = PlanDriver(runner)
    prompt = _prompt(21)
    drv.add(1, prompt)
    logits = []
    for _ in range(20):
        drv.step({1: 64})
        logits.append(runner.last_logits[0])
    assert drv.seqs[1].outputs == hf_greedy(hf, prompt, 20)
    ref = hf_logits(hf, drv.seqs[1].tokens)[len(prompt) - 1: -1]
    assert _rel_err(torch.stack(logits), ref) < REL_TOL


@pytest.mark.parametrize("cpu_attention", ["fused", "torch"])
def test_mixed_prompt_lengths_in_one_batch(arch_setup, cpu_attention):
    _, path, model, hf = arch_setup
    drv = PlanDriver(make_runner(path, model=model, cpu_attention=cpu_attention))
    prompts = {i: _prompt(n, i) for i, n in enumerate([3, 17, 33, 40])}
    for sid, p in prompts.items():
        drv.add(sid, p)
    drv.run_until(12)
    for sid, p in prompts.items():
        assert drv.seqs[sid].outputs == hf_greedy(hf, p, 12), sid


@pytest.mark.parametrize("cpu_attention", ["fused", "torch"])
def test_chunked_prefill_mixed_with_decodes(tiny_llama_dir, cpu_attention):
    hf = _hf(tiny_llama_dir)
    drv = PlanDriver(make_runner(tiny_llama_dir, cpu_attention=cpu_attention))
    short, long = _prompt(4, 7), _prompt(45, 8)
    drv.add(1, short)
    drv.step({1: 4})  # seq 1 now decodes while seq 2 prefills in chunks of 5
    drv.add(2, long)
    drv.run_until(10, chunk=5)
    assert drv.seqs[1].outputs == hf_greedy(hf, short, 10)
    assert drv.seqs[2].outputs == hf_greedy(hf, long, 10)


def test_second_sequence_reuses_cached_prefix(tiny_qwen2_dir):
    check_prefix_hit(make_runner(tiny_qwen2_dir), _hf(tiny_qwen2_dir), _prompt(40, 3), _prompt(9, 4))


def test_swap_out_and_in_restores_the_cache(tiny_llama_dir):
    runner = make_runner(tiny_llama_dir)
    check_swap_round_trip(runner, _hf(tiny_llama_dir), _prompt(37, 5), [runner.kv])


def test_fork_append_tokens_and_copy_on_write(tiny_mistral_dir):
    check_fork_with_copy_on_write(make_runner(tiny_mistral_dir), _hf(tiny_mistral_dir), _prompt(20, 6))


@pytest.mark.parametrize("rope", [
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
])
def test_rope_scaling_logits_match(tiny_checkpoint, rope):
    path = tiny_checkpoint("llama", "small", rope_parameters=rope)
    hf = _hf(path)
    runner = make_runner(path)
    runner.keep_logits = True
    drv = PlanDriver(runner)
    prompt = _prompt(50, 9)
    drv.add(1, prompt)
    drv.step({1: 64})
    assert _rel_err(runner.last_logits[0], hf_logits(hf, prompt)[-1]) < REL_TOL
    drv.run_until(8)
    assert drv.seqs[1].outputs == hf_greedy(hf, prompt, 8)
