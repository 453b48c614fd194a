"""Where the CUDA path's model tests run its kernels: on the CPU, every kernel executed from its source
by the SIMT emulator (CI), or on a GPU with the real launchers (``make gpu-check``); with the model
and runner those tests build on the CuPy attention backend, and call counters on either side.
The fixtures that pick the site are in tests/unit/kernels/conftest.py."""

from __future__ import annotations

from collections import Counter

import torch

from cupy_kernels.build import (
    KernelKey,
    group_size,
    mma_prefill_supported,
    prefill_mma_tokens,
    prefill_tokens,
)
from executor_svc.model.cuda_layers import install
from testing.lora_adapters import torch_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


class Counted:
    """``fn`` with its calls counted in ``calls[name]``."""

    def __init__(self, fn, calls: Counter, name: str) -> None:
        self.fn, self.calls, self.name = fn, calls, name

    def __call__(self, *args, **kwargs):
        self.calls[self.name] += 1
        return self.fn(*args, **kwargs)


class KernelSite:
    """Where the kernels run: ``emulator`` (the CPU, launchers patched) or ``cuda``."""

    def __init__(self, name: str) -> None:
        self.name, self.device = name, "cpu" if name == "emulator" else "cuda"
        self.fused = None  # the fused kernels' object (None on CUDA: cuda_layers picks the launchers)
        self.attention = None

    @classmethod
    def emulator(cls) -> KernelSite:
        """The kernels' sources on the SIMT emulator, for the tiny model (4 q / 2 KV heads of 16,
        blocks of 16) in float32 and bfloat16."""
        from testing.kernels.emulate import Emulator
        from testing.kernels.emulate_fused import FusedEmulator

        site = cls("emulator")
        g = group_size(2)
        site.attention = Emulator([k for d in DTYPES for k in (
            KernelKey("decode", d, 16, 16, g), KernelKey("decode_reduce", d, 16),
            KernelKey("prefill", d, 16, 16, g, prefill_tokens(g)))] +
            # (16-bit prefills take the tensor-core kernel, as on the GPU)
            [KernelKey("prefill_mma", d, 16, 16, g, prefill_mma_tokens(g)) for d in DTYPES
             if mma_prefill_supported(d, 16)])
        site.fused = FusedEmulator()
        return site

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


class CountedKernels:
    """The fused kernels' object, each call counted by name."""

    def __init__(self, kernels) -> None:
        self.kernels, self.calls = kernels, Counter()

    def __getattr__(self, name: str):
        return Counted(getattr(self.kernels, name), self.calls, name)


def cuda_model(model_dir, site: KernelSite, dtype: torch.dtype, fused: bool):
    """(the model on ``site``'s device in ``dtype``, its counted fused kernels or None)."""
    from executor_svc.model.cuda_layers import cuda_kernels

    model = torch_model(model_dir).to(site.device, dtype)
    model.rotary.inv_freq = model.rotary.inv_freq.to(site.device)
    kernels = None
    if fused:
        kernels = CountedKernels(site.fused if site.fused is not None else cuda_kernels())
        install(model, kernels=kernels)
    return model, kernels


def cupy_runner(model, num_blocks: int = 48):
    """A runner of ``model`` on the CuPy attention backend, keeping each step's sampled logits."""
    from executor_svc.attention_cupy import CupyAttentionBackend
    from executor_svc.kv_cache import KVCache
    from executor_svc.runner import ModelRunner
    from executor_svc.sampler import Sampler

    kv = KVCache(model.cfg, 16, num_blocks, 0, model.dtype, model.device)
    runner = ModelRunner(model, kv, CupyAttentionBackend(), Sampler(seed=0))
    runner.keep_logits = True
    return runner
