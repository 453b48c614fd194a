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
           "int8": ({"quantization": "int8"}, torch.float32, 1e-2),
           "Q4_1": ({"quantization": "gguf"}, torch.float32, 1e-2)}  # (Q4_1: a GGUF file's blocks)


class _Spy:
    """The model's decode stack, recording its calls (rows per call) and the logits each returned."""

    def __init__(self, inner) -> None:
        self.inner, self.calls, self.logits = inner, [], []

    def __call__(self, *args):
        self.calls.append(args[0].shape[0])
        hidden, logits = self.inner(*args)
        self.logits.append(logits)
        return hidden, logits

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(1, vocab, (int(torch.randint(3, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v bias, tied embeddings
@pytest.mark.parametrize("num_seqs", [1, 3, 20])  # 20: past the per-thread conversions (16), shared ones
def test_stack_matches_the_modules(tiny_checkpoint, tiny_gguf, fmt, arch, num_seqs):
    kwargs, kv_dtype, tol = FORMATS[fmt]
    model = load_model(tiny_gguf(arch, fmt) if fmt.startswith("Q") else tiny_checkpoint(arch, "small"), **kwargs)
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
        assert torch.equal(ours, spy.logits[-1])  # the step's logits are those its one C call returned
        tokens = ref.argmax(-1)
    assert spy.calls == [num_seqs] * 6  # every decode step took the fused path, no prefill did


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("num_seqs", [1, 20])
def test_stack_equals_the_modules_bit_for_bit(tiny_checkpoint, tiny_gguf, fmt, arch, num_seqs):
    """On the fused attention backend the modules run the stack's own C functions (norms, rotary,
    projections, attention, SiLU): a decode step gives the same bits on either path."""
    kwargs, kv_dtype, _ = FORMATS[fmt]
    model = load_model(tiny_gguf(arch, fmt) if fmt.startswith("Q") else tiny_checkpoint(arch, "small"), **kwargs)
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


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_a_verification_step_runs_the_stack_and_equals_the_modules_bit_for_bit(tiny_checkpoint, tiny_gguf, fmt, arch):
    """Sequences adding several tokens at once, every row scored (a speculative verification, k + 1
    rows each; beside them one plain decode row): the stack runs it in one call, each row a decode
    query over its sequence's table cut at its position, and every row's logits are the modules'
    bits, the rows' K/V written into the cache the same way (the next step agrees too)."""
    kwargs, kv_dtype, _ = FORMATS[fmt]
    model = load_model(tiny_gguf(arch, fmt) if fmt.startswith("Q") else tiny_checkpoint(arch, "small"), **kwargs)
    stack = spy = _Spy(model.decode_stack)
    prompts = _prompts(4, model.cfg.vocab_size)
    fused, modules = Forcer(model, kv_dtype, 4, 96), Forcer(model, kv_dtype, 4, 96)
    for forcer in (fused, modules):
        for i, p in enumerate(prompts):
            forcer.step([i], [p])
    g = torch.Generator().manual_seed(7)
    seqs = [0, 1, 2, 3]
    threads = torch.get_num_threads()
    torch.set_num_threads(8)  # (rows of one sequence on several threads at once)
    for new in ([5, 1, 3, 2], [1, 4, 1, 5], [8, 8, 8, 8]):  # rows per sequence: a verification of k = new - 1
        tokens = [torch.randint(1, model.cfg.vocab_size, (n,), generator=g).tolist() for n in new]
        ids = torch.tensor([t for ts in tokens for t in ts])
        outs = []
        for forcer, runs_stack in ((fused, True), (modules, False)):
            meta, positions = forcer._meta(seqs, new)
            model.decode_stack = spy if runs_stack else None
            try:
                with torch.inference_mode():
                    hidden, logits = model.forward_with_logits(ids, positions, forcer.kv.layers, meta, forcer.backend,
                                                               every_row_scored=True)
            finally:
                model.decode_stack = stack
            outs.append(logits if logits is not None else model.compute_logits(hidden))
        assert spy.calls[-1] == sum(new)  # one C call, a row per new token
        ours, ref = outs
        assert torch.equal(ours, ref), f"{fmt} {arch}: differ by up to {float((ours - ref).abs().max())}"
    torch.set_num_threads(threads)
    last_rows = torch.tensor(new).cumsum(0) - 1
    after = [[int(t)] for t in ref.argmax(-1)[last_rows]]  # each sequence's last row
    assert torch.equal(fused.step(seqs, after), modules.step(seqs, after))  # the caches hold the same K/V


def test_a_block_id_outside_the_cache_is_refused(tiny_llama_dir):
    model = load_model(tiny_llama_dir)
    forcer = Forcer(model, torch.float32, 1, 32)
    forcer.step([0], [[5, 6, 7]])
    meta, positions = forcer._meta([0], [1])
    meta.block_tables[0, 0] = forcer.kv.num_blocks  # one past the end
    with pytest.raises(ValueError, match="outside the cache"), torch.inference_mode():
        model(torch.tensor([8]), positions, forcer.kv.layers, meta, forcer.backend)


def test_the_fused_step_is_chosen_by_what_the_backend_does_not_by_its_name(tiny_llama_dir):
    """A backend whose kernel the stack runs takes the fused step whatever it is called; one that
    does not never does, even under the fused backend's name."""
    from executor_svc.attention import TorchAttentionBackend
    from executor_svc.attention_cpu import FusedCpuAttentionBackend

    class Renamed(FusedCpuAttentionBackend):
        name = "something-else"

    class Impostor(TorchAttentionBackend):
        name = "cpu-fused"

    model = load_model(tiny_llama_dir)
    model.decode_stack = spy = _Spy(model.decode_stack)
    forcer = Forcer(model, torch.float32, 1, 32)
    fused = forcer.backend
    assert isinstance(fused, FusedCpuAttentionBackend)
    forcer.step([0], [[5, 6, 7]])
    got = {}
    for label, backend in (("renamed", Renamed(fused.kernel)), ("impostor", Impostor())):
        forcer.backend, calls = backend, len(spy.calls)
        meta, positions = forcer._meta([0], [1])
        forcer.lens[0] -= 1  # (the same position again: both compute token 8 after 5, 6, 7)
        with torch.inference_mode():
            hidden, logits = model.forward_with_logits(torch.tensor([8]), positions, forcer.kv.layers, meta, backend)
        got[label] = (len(spy.calls) - calls, logits)
    assert got["renamed"][0] == 1 and got["renamed"][1] is not None and got["renamed"][1].shape[0] == 1
    assert got["impostor"] == (0, None)  # the modules ran, and the runner computes the logits it wants
