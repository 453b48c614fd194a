"""The fused decoder-layer kernels (``cupy_kernels/fused_layers.cu``) run on the CPU by the SIMT
emulator, with the launchers' argument checks and grids (tests only; see ``emulate.py``)."""

from __future__ import annotations

import ctypes

import torch

from cupy_kernels import checks, fused_layers
from cupy_kernels.build import CUDA_TYPES, SRC_DIR
from testing.kernels.emulate import _build, _ptrs

_VOID = ctypes.c_void_p


def _wrappers(dtype: str) -> str:
    t, th = CUDA_TYPES[dtype], fused_layers.THREADS
    return f"""
extern "C" void add_rms_norm_{dtype}(unsigned n, void* out, void* res, const void* delta, const void* w,
    int hidden, float eps) {{
  emu::launch(dim3{{n, 1, 1}}, {th}, [&] {{ ps_add_rms_norm<{t}>(({t}*)out, ({t}*)res, (const {t}*)delta,
      (const {t}*)w, hidden, eps); }});
}}
extern "C" void silu_and_mul_{dtype}(unsigned n, void* out, const void* gu, int inter) {{
  emu::launch(dim3{{n, 1, 1}}, {th}, [&] {{ ps_silu_and_mul<{t}>(({t}*)out, (const {t}*)gu, inter); }});
}}
extern "C" void rope_and_cache_{dtype}(unsigned n, void* q, void* k, const void* v, void* kc, void* vc,
    const long long* pos, const long long* slots, const float* inv, long long qs, long long kvs,
    int nq, int nkv, int head) {{
  emu::launch(dim3{{n, 1, 1}}, {th}, [&] {{ ps_rope_and_cache<{t}>(({t}*)q, ({t}*)k, (const {t}*)v,
      ({t}*)kc, ({t}*)vc, pos, slots, inv, qs, kvs, nq, nkv, head); }});
}}"""


class FusedEmulator:
    """The three kernels for every storage dtype, compiled once into one library."""

    def __init__(self) -> None:
        source = "\n".join([f'#include "{SRC_DIR / fused_layers.SOURCE}"'] + [_wrappers(d) for d in CUDA_TYPES])
        self.lib = ctypes.CDLL(str(_build(source)))

    def add_rms_norm(self, residual, delta, weight, eps: float, out) -> None:
        fused_layers.check_add_rms_norm(out, residual, delta, weight)
        fn = getattr(self.lib, f"add_rms_norm_{checks.DTYPES[residual.dtype]}")
        fn(residual.shape[0], *_ptrs(out, residual), _VOID(0 if delta is None else delta.data_ptr()),
           *_ptrs(weight), residual.shape[1], ctypes.c_float(eps))

    def silu_and_mul(self, gate_up, out) -> None:
        fused_layers.check_silu_and_mul(out, gate_up)
        fn = getattr(self.lib, f"silu_and_mul_{checks.DTYPES[gate_up.dtype]}")
        fn(gate_up.shape[0], *_ptrs(out, gate_up), gate_up.shape[1] // 2)

    def rope_and_cache(self, query, key, value, k_cache, v_cache, positions, slot_mapping,
                       inv_freq: torch.Tensor) -> None:
        fused_layers.check_rope_and_cache(query, key, value, k_cache, v_cache, positions, slot_mapping,
                                          inv_freq)
        fn = getattr(self.lib, f"rope_and_cache_{checks.DTYPES[k_cache.dtype]}")
        fn(positions.shape[0], *_ptrs(query, key, value, k_cache, v_cache, positions, slot_mapping, inv_freq),
           ctypes.c_longlong(query.stride(0)), ctypes.c_longlong(key.stride(0)), query.shape[1],
           key.shape[1], key.shape[2])
