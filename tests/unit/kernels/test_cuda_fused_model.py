"""The model's forward on the fused layer kernels (executor_svc/model/cuda_layers.py) against its eager
torch modules, both with the CuPy attention backend, through the runner: prefill, chunked prefill over
cached blocks, mixed and decode steps, GQA (the tiny model's 4 q / 2 KV heads). Run twice: on the CPU
with every CUDA kernel (fused layers, attention, cache write) executed from its source by the SIMT
emulator (in CI), and on a GPU with the real launchers (marked ``gpu``; ``make gpu-check``).

Greedy tokens must be equal and logits close; the KV cache the fused RoPE kernel writes must match
the one the backend's write_kv writes, and the backend's write must not run at all."""

from __future__ import annotations

import importlib.util
from collections import Counter

import pytest
import torch

from cupy_kernels.build import KernelKey, group_size, prefill_tokens
from executor_svc.model.cuda_layers import install
from testing.kernels.reference import rel_error
from testing.lora_adapters import torch_model
from testing.plan_driver import PlanDriver

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
TOL = {"float32": 1e-5, "bfloat16": 1e-2}
PROMPTS = [[(5 * i + 2) % 300 + 1 for i in range(n)] for n in (11, 4, 19)]
_HAVE_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


class Counted:
    """``fn`` with its calls counted in ``calls[name]``."""

    def __init__(self, fn, calls: Counter, name: str) -> None:
        self.fn, self.calls, self.name = fn, calls, name

    def __call__(self, *args, **kwargs):
        self.calls[self.name] += 1
        return self.fn(*args, **kwargs)


class _Where:
    """Where the kernels run: ``emulator`` (the CPU, launchers patched) or ``cuda``."""

    def __init__(self, name: str) -> None:
        self.name, self.device = name, "cpu" if name == "emulator" else "cuda"
        self.fused = None  # the fused kernels' object (None on CUDA: cuda_layers picks the launchers)
        self.attention = None

    def patch(self, monkeypatch) -> Counter:
        """Launcher calls by name (attention and the backend's cache write), counted on either side."""
        from cupy_kernels import cache_ops, launchers

        if self.name == "emulator":
            from testing.kernels.emulate import emulate_launchers

            return emulate_launchers(self.attention, monkeypatch)
        calls = Counter()
        for module, name, short in ((launchers, "paged_attention_decode", "decode"),
                                    (launchers, "paged_attention_prefill", "prefill"),
                                    (cache_ops, "reshape_and_cache", "reshape_and_cache")):
            monkeypatch.setattr(module, name, Counted(getattr(module, name), calls, short))
        return calls


@pytest.fixture(scope="module", params=["emulator", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not _HAVE_GPU, reason="needs a CUDA GPU and CuPy (run make gpu-check)")])])
def where(request):
    w = _Where(request.param)
    if w.name == "emulator":
        from testing.kernels.emulate import Emulator
        from testing.kernels.emulate_fused import FusedEmulator

        g = group_size(2)  # the tiny model: 4 q / 2 KV heads of 16, blocks of 16
        w.attention = Emulator([k for d in DTYPES for k in (
            KernelKey("decode", d, 16, 16, g), KernelKey("decode_reduce", d, 16),
            KernelKey("prefill", d, 16, 16, g, prefill_tokens(g)))])
        w.fused = FusedEmulator()
    return w


class CountedKernels:
    """The fused kernels' object, each call counted by name."""

    def __init__(self, kernels) -> None:
        self.kernels, self.calls = kernels, Counter()

    def __getattr__(self, name: str):
        return Counted(getattr(self.kernels, name), self.calls, name)


def _model(model_dir, where: _Where, dtype: torch.dtype, fused: bool):
    from executor_svc.model.cuda_layers import cuda_kernels

    model = torch_model(model_dir).to(where.device, dtype)
    model.rotary.inv_freq = model.rotary.inv_freq.to(where.device)
    kernels = None
    if fused:
        kernels = CountedKernels(where.fused if where.fused is not None else cuda_kernels())
        install(model, kernels=kernels)
    return model, kernels


def _runner(model):
    from executor_svc.attention_cupy import CupyAttentionBackend
    from executor_svc.kv_cache import KVCache
    from executor_svc.runner import ModelRunner
    from executor_svc.sampler import Sampler

    kv = KVCache(model.cfg, 16, 48, 0, model.dtype, model.device)
    runner = ModelRunner(model, kv, CupyAttentionBackend(), Sampler(seed=0))
    runner.keep_logits = True
    return runner


def _serve(runner, max_new: int = 5, chunk: int = 7) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prompts of 11, 4 and 19 tokens in chunks of 7 (a fresh prompt, chunks over cached blocks, a
    prompt done beside another's chunk), then decode steps; outputs and each step's sampled logits."""
    drv = PlanDriver(runner)
    for sid, p in enumerate(PROMPTS):
        drv.add(sid, p)
    logits = []
    while todo := {sid: chunk for sid in drv.seqs if len(drv.seqs[sid].outputs) < max_new}:
        drv.step(todo)
        logits.append(runner.last_logits.cpu())
    return [drv.seqs[s].outputs for s in sorted(drv.seqs)], logits


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_layers_generate_like_the_eager_modules(where, tiny_llama_dir, monkeypatch, dtype):
    calls = where.patch(monkeypatch)
    eager = _runner(_model(tiny_llama_dir, where, DTYPES[dtype], fused=False)[0])
    want, want_logits = _serve(eager)
    assert calls["reshape_and_cache"] > 0
    calls.clear()
    model, kernels = _model(tiny_llama_dir, where, DTYPES[dtype], fused=True)
    fused = _runner(model)
    got, got_logits = _serve(fused)
    assert got == want
    assert len(got_logits) == len(want_logits)
    for i, (g, w) in enumerate(zip(got_logits, want_logits, strict=True)):
        assert rel_error(g, w) < TOL[dtype], f"step {i}"
    for (fk, fv), (ek, ev) in zip(fused.kv.layers, eager.kv.layers, strict=True):
        assert rel_error(fk, ek) < TOL[dtype] and rel_error(fv, ev) < TOL[dtype]
    steps, layers = len(got_logits), model.cfg.num_layers
    assert calls["reshape_and_cache"] == 0, "the backend wrote K/V although the fused kernel did"
    assert calls["decode"] > 0 and calls["prefill"] > 0  # (both attention kernels ran)
    assert kernels.calls == {"rope_and_cache": steps * layers, "silu_and_mul": steps * layers,
                             "add_rms_norm": steps * (2 * layers + 1)}


def test_fused_layers_replay_in_decode_graphs(where, tiny_llama_dir, monkeypatch):
    """Decode steps through DecodeGraphs (on a GPU captured as CUDA graphs: the fused kernels must not
    sync the host; on the CPU its eager twin) give the eager model's tokens."""
    from executor_svc.decode_graphs import DecodeGraphs

    where.patch(monkeypatch)
    want = _serve(_runner(_model(tiny_llama_dir, where, torch.float32, fused=False)[0]), max_new=8)[0]
    runner = _runner(_model(tiny_llama_dir, where, torch.float32, fused=True)[0])
    runner.graphs = DecodeGraphs(runner.model, runner.kv, runner.backend, 256, (1, 2, 4))
    runner.graphs.capture_all()
    assert _serve(runner, max_new=8)[0] == want
    assert runner.graphs.replays > 0
