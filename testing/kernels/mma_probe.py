"""Run testing/kernels/mma_probe.cu (one m16n8k16 mma per warp) on the SIMT emulator or on a GPU.

Inputs: ``a [warps, 16, 16]`` and ``b [warps, 16, 8]`` float16/bfloat16, ``c [warps, 16, 8]``
float32; returns ``a @ b + c`` as the tensor cores (or the emulator) compute it, float32.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from cupy_kernels.build import CUDA_TYPES, SRC_DIR, nvrtc_options

PROBE = Path(__file__).resolve().parent / "mma_probe.cu"
THREADS_PER_WARP = 32


def _check(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> int:
    warps = a.shape[0]
    if a.shape != (warps, 16, 16) or b.shape != (warps, 16, 8) or c.shape != (warps, 16, 8):
        raise ValueError(f"shapes: a [w,16,16], b [w,16,8], c [w,16,8], got {a.shape} {b.shape} {c.shape}")
    if a.dtype != b.dtype or a.dtype not in (torch.float16, torch.bfloat16) or c.dtype != torch.float32:
        raise ValueError(f"dtypes: a and b float16/bfloat16, c float32, got {a.dtype} {b.dtype} {c.dtype}")
    return warps


def emulated(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    from testing.kernels.emulate import _build

    warps = _check(a, b, c)
    t = CUDA_TYPES[str(a.dtype).removeprefix("torch.")]
    source = PROBE.read_text() + f"""
extern "C" void probe(unsigned threads, float* d, const unsigned short* a, const unsigned short* b, const float* c) {{
  emu::launch(dim3{{1, 1, 1}}, threads, [&] {{ ps_mma_probe<{t}>(d, a, b, c); }});
}}"""
    lib = ctypes.CDLL(str(_build(source)))
    a, b, c = a.contiguous(), b.contiguous(), c.contiguous()
    d = torch.full_like(c, float("nan"))
    lib.probe(warps * THREADS_PER_WARP, *[ctypes.c_void_p(x.data_ptr()) for x in (d, a, b, c)])
    return d


def on_gpu(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    import cupy

    warps = _check(a, b, c)
    header = (SRC_DIR / "common.cuh").read_text().replace("#pragma once\n", "")
    code = PROBE.read_text().replace('#include "common.cuh"\n', header)
    expr = f"ps_mma_probe<{CUDA_TYPES[str(a.dtype).removeprefix('torch.')]}>"
    fn = cupy.RawModule(code=code, options=nvrtc_options(), name_expressions=[expr]).get_function(expr)
    a, b, c = (x.contiguous().cuda() for x in (a, b, c))
    d = torch.full_like(c, float("nan"))
    with cupy.cuda.Device(d.device.index or 0):
        fn((1,), (warps * THREADS_PER_WARP,), tuple(cupy.uint64(x.data_ptr()) for x in (d, a, b, c)))
    torch.cuda.synchronize()
    return d.cpu()
