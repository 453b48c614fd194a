"""The batched LoRA kernels (``cupy_kernels/lora.cu``) run on the CPU by the SIMT emulator, with the
launchers' argument checks and grids (tests only; see ``emulate.py``). It has the launchers' call
shape (``shrink``, ``expand``), so ``executor_svc/lora/apply.py`` can run its kernel path on it."""

from __future__ import annotations

import ctypes

import torch

from cupy_kernels import checks, lora
from cupy_kernels.build import CUDA_TYPES, SRC_DIR
from testing.kernels.emulate import _build, _ptrs


def _wrappers(dtype: str, tokens: int) -> str:
    t = CUDA_TYPES[dtype]
    return f"""
extern "C" void shrink_{dtype}_{tokens}(unsigned gx, unsigned gy, float* t, const void* x, const float* a,
    const int* b, const int* slots, long long xs, int n, int ns, int r, int n_in) {{
  emu::launch(dim3{{gx, gy, 1}}, {lora.SHRINK_WARPS * 32}, [&] {{
    ps_lora_shrink<{t}, {tokens}>(t, (const {t}*)x, a, b, slots, xs, n, ns, r, n_in); }});
}}
extern "C" void expand_{dtype}_{tokens}(unsigned gx, unsigned gy, void* y, const float* t, const float* bt,
    const int* b, const int* slots, long long ys, int n, int ns, int r, int out) {{
  emu::launch(dim3{{gx, gy, 1}}, {lora.EXPAND_THREADS}, [&] {{
    ps_lora_expand<{t}, {tokens}>(({t}*)y, t, bt, b, slots, ys, n, ns, r, out); }});
}}"""


class LoraEmulator:
    """Both kernels for every activation dtype, compiled once into one library."""

    def __init__(self) -> None:
        source = "\n".join([f'#include "{SRC_DIR / lora.SOURCE}"']
                            + [_wrappers(d, n) for d in CUDA_TYPES for n in (1, lora.TILE)])
        self.lib = ctypes.CDLL(str(_build(source)))
        self.launches = 0  # kernel launches so far (tests check the kernel path was taken)

    def shrink(self, t: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bounds: torch.Tensor,
               token_slots: torch.Tensor, tokens: int | None = None) -> torch.Tensor:
        lora.check_shrink(t, x, a, bounds, token_slots)
        n, (slots, r, n_in) = token_slots.shape[0], a.shape
        tokens = lora.tokens_per_block(n) if tokens is None else tokens
        if n and r:
            gx, gy, _ = lora.shrink_grid(n, r, tokens)
            getattr(self.lib, f"shrink_{checks.DTYPES[x.dtype]}_{tokens}")(
                gx, gy, *_ptrs(t, x, a, bounds, token_slots), ctypes.c_longlong(x.stride(0)), n, slots, r, n_in)
            self.launches += 1
        return t

    def expand(self, y: torch.Tensor, t: torch.Tensor, bt: torch.Tensor, bounds: torch.Tensor,
               token_slots: torch.Tensor, width: int | None = None, tokens: int | None = None) -> torch.Tensor:
        width = bt.shape[2] if width is None else width
        lora.check_expand(y, t, bt, bounds, token_slots, width)
        n, (slots, r, out) = token_slots.shape[0], bt.shape
        tokens = lora.tokens_per_block(n) if tokens is None else tokens
        if n and width:
            gx, gy, _ = lora.expand_grid(n, width, tokens)
            getattr(self.lib, f"expand_{checks.DTYPES[y.dtype]}_{tokens}")(
                gx, gy, *_ptrs(y, t, bt, bounds, token_slots), ctypes.c_longlong(y.stride(0)), n, slots, r, out)
            self.launches += 1
        return y
