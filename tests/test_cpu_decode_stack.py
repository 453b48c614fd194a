"""The fused CPU decode stack (csrc/decode_stack_cpu.c) against the same packed model run
operator by operator (torch attention), in every weight format, and its checks."""

from __future__ import annotations

import pytest
import torch

from executor_svc.backends import make_attention_backend
from executor_svc.model import load_model
from testing.cpu_agreement import Forcer

# (load_model arguments, KV cache dtype, tolerance relative to the largest logit). The two paths
# order their float sums differently; in bf16 and int8 that moves an activation's rounding now
# and then, which a wrong head, position or weight would exceed by far (errors of order 1).
FORMATS = {"float32": ({}, torch.float32, 1e-4), "bfloat16": ({"dtype": torch.bfloat16}, torch.bfloat16, 1e-2),
           "int8": ({"quantization": "int8"}, torch.float32, 1e-2)}


class _Spy:
    """The model's decode stack, counting its calls (rows per call)."""

    def __init__(self, inner) -> None:
        self.inner, self.calls, self.logits_served = inner, [], 0

    def __call__(self, *args):
        self.calls.append(args[0].shape[0])
        return self.inner(*args)

    def logits_for(self, hidden):
        done = self.inner.logits_for(hidden)
        self.logits_served += done is not None
        return done

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(1, vocab, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v bias, tied embeddings
@pytest.mark.parametrize("num_seqs", [1, 3, 20])  # 20: past the per-thread conversions (16), shared ones
def test_stack_matches_the_modules(tiny_checkpoint, fmt, arch, num_seqs):
    kwargs, kv_dtype, tol = FORMATS[fmt]
    model = load_model(tiny_checkpoint(arch, "small"), **kwargs)
    model.decode_stack = spy = _Spy(model.decode_stack)
    prompts = _prompts(num_seqs, model.cfg.vocab_size)
    fused, modules = (Forcer(model, kv_dtype, num_seqs, 64) for _ in range(2))
    first = [fused.step([i], [p]) for i, p in enumerate(prompts)]  # prefills: the modules in both
    for i, p in enumerate(prompts):
        modules.step([i], [p])
    modules.backend = make_attention_backend("cpu", "torch")  # decode steps: the modules with SDPA
    tokens = torch.cat(first).argmax(-1)
    seqs = list(range(num_seqs))
    for _ in range(6):
        ours = fused.step(seqs, [[int(t)] for t in tokens])
        ref = modules.step(seqs, [[int(t)] for t in tokens])
        torch.testing.assert_close(ours, ref, rtol=0, atol=tol * float(ref.abs().max()))
        tokens = ref.argmax(-1)
    assert spy.calls == [num_seqs] * 6  # every decode step took the fused path, no prefill did
    assert spy.logits_served == 6  # and computed its logits in the same call


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("num_seqs", [1, 20])
def test_stack_equals_the_modules_bit_for_bit(tiny_checkpoint, fmt, arch, num_seqs):
    """On the fused attention backend the modules run the stack's own C functions (norms, rotary,
    projections, attention, SiLU): a decode step gives the same bits on either path."""
    kwargs, kv_dtype, _ = FORMATS[fmt]
    model = load_model(tiny_checkpoint(arch, "small"), **kwargs)
    stack = model.decode_stack
    prompts = _prompts(num_seqs, model.cfg.vocab_size)
    fused, modules = Forcer(model, kv_dtype, num_seqs, 64), Forcer(model, kv_dtype, num_seqs, 64)
    tokens = torch.cat([fused.step([i], [p]) for i, p in enumerate(prompts)]).argmax(-1)
    for i, p in enumerate(prompts):
        modules.step([i], [p])
    seqs = list(range(num_seqs))
    for _ in range(4):
        ours = fused.step(seqs, [[int(t)] for t in tokens])
        model.decode_stack = None
        try:
            ref = modules.step(seqs, [[int(t)] for t in tokens])
        finally:
            model.decode_stack = stack
        assert torch.equal(ours, ref), f"{fmt} {arch}: differ by up to {float((ours - ref).abs().max())}"
        tokens = ref.argmax(-1)


def test_a_block_id_outside_the_cache_is_refused(tiny_llama_dir):
    model = load_model(tiny_llama_dir)
    forcer = Forcer(model, torch.float32, 1, 32)
    forcer.step([0], [[5, 6, 7]])
    meta, positions = forcer._meta([0], [1])
    meta.block_tables[0, 0] = forcer.kv.num_blocks  # one past the end
    with pytest.raises(ValueError, match="outside the cache"), torch.inference_mode():
        model(torch.tensor([8]), positions, forcer.kv.layers, meta, forcer.backend)
