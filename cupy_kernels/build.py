"""Kernel sources, template instantiation names and the compile cache.

The ``.cu`` files next to this module are compiled two ways from the same text:

* at run time by CuPy (NVRTC) through ``cupy.RawModule(name_expressions=...)``, one module per
  kernel configuration, cached for the life of the process (:func:`get_function`);
* in CI by ``nvcc -cubin`` (tests/unit/kernels/test_cuda_compile.py), through a translation unit that
  instantiates a representative set of the same templates (:func:`nvcc_unit`).

``common.cuh`` is pasted in place of its ``#include`` for NVRTC, so the compile cache (keyed by
the full source text) can never serve a module built from a stale header.
"""

from __future__ import annotations

import functools
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from pagedserve import wire

SRC_DIR = Path(__file__).resolve().parent
SOURCES = ("paged_decode.cu", "paged_prefill.cu", "paged_prefill_mma.cu", "cache_ops.cu", "fused_layers.cu",
           "lora.cu")

# CUDA spelling of each supported storage type (torch / numpy dtype name -> C++ type).
CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16"}
HEAD_SIZES = (16, 32, 64, 80, 96, 128, 256)  # 16 and 32: the tiny test models
BLOCK_SIZES = wire.BLOCK_SIZES  # every block size the services accept
MAX_GROUP = 8  # q heads handled by one thread block (bounded by registers, see paged_decode.cu)
PREFILL_ROWS = 16  # (query token, q head) rows per prefill thread block
MMA_ROWS = 64  # rows per block of the tensor-core prefill kernel (4 warps x one m16 tile)
MMA_DTYPES = ("float16", "bfloat16")  # mma.sync operand types; float32 keeps the SIMT kernel
MMA_HEAD_SIZES = (16, 32, 64, 80, 96, 128)  # 256: O + Q + S fragments overflow the registers
PARTITION_SIZE = 512  # tokens per partition of the split decode kernel
MAX_PARTITIONS = 1024  # PS_MAX_PARTS in paged_decode.cu


@dataclass(frozen=True, slots=True)
class DecodeKernel:
    """Template parameters of one decode-kernel variant (paged_decode.cu: WARPS, TILEH, PIPE)."""

    warps: int = 4  # warps per thread block
    tile_halves: int = 2  # tokens a lane loads per tile, in halves of the default rule's
    pipeline: bool = False  # next tile's K/V loads issued before this tile's compute


# "base" is the kernel the launcher's "auto" runs; the others wait for a GPU measurement.
# pipe_half: the pipelined tile halved, so its two tiles take the registers of one (16 warps per SM).
DECODE_KERNELS = {"base": DecodeKernel(), "pipe": DecodeKernel(pipeline=True),
                  "pipe_half": DecodeKernel(tile_halves=1, pipeline=True), "nt2": DecodeKernel(tile_halves=4),
                  "w8": DecodeKernel(warps=8), "pipe_w8": DecodeKernel(warps=8, pipeline=True)}
SHARED_BYTES = 48 * 1024  # static shared memory per block
# Tensor-core prefill kernels (paged_prefill_mma.cu's PIPE): "base" loads each K/V tile, then computes
# on it; "pipe" fetches the next tile with cp.async while computing on this one. The launcher's
# "auto" runs "base" until a GPU run (make gpu-check's prefill rows) shows "pipe" faster.
PREFILL_MMA_KERNELS = ("base", "pipe")


def decode_warps(kernel: str, group: int, head_size: int) -> int:
    """Warps the decode kernel ``kernel`` runs with: its own, unless the end-of-kernel merge of that
    many warps (per warp: G x (head + 2) floats of shared memory) would not fit, then 4."""
    warps = DECODE_KERNELS[kernel].warps
    return warps if warps * group * (head_size + 2) * 4 <= SHARED_BYTES else 4


def group_size(q_per_kv: int) -> int:
    """q heads per thread block: the largest divisor of q_per_kv that is at most MAX_GROUP."""
    if q_per_kv <= 0:
        raise ValueError(f"q_per_kv: expected >= 1, got {q_per_kv}")
    return max(g for g in range(1, MAX_GROUP + 1) if q_per_kv % g == 0)


def prefill_tokens(group: int) -> int:
    """Query tokens per prefill thread block (ROWS = tokens * group <= PREFILL_ROWS)."""
    return max(1, PREFILL_ROWS // group)


def prefill_mma_tokens(group: int) -> int:
    """Query tokens per tensor-core prefill block (tokens * group <= MMA_ROWS)."""
    return max(1, MMA_ROWS // group)


def mma_prefill_supported(dtype: str, head_size: int) -> bool:
    return dtype in MMA_DTYPES and head_size in MMA_HEAD_SIZES


@dataclass(frozen=True, slots=True)
class KernelKey:
    """One compiled configuration; also the compile-cache key."""

    kind: str  # "decode" | "decode_reduce" | "prefill" | "prefill_mma" | "cache_ops"
    dtype: str = "float32"  # key of CUDA_TYPES
    head_size: int = 0
    block_size: int = 0
    group: int = 0  # q heads per block (decode, prefill)
    tokens: int = 0  # query tokens per block (prefill)
    variant: str = "base"  # decode: a key of DECODE_KERNELS; prefill_mma: one of PREFILL_MMA_KERNELS

    @property
    def threads(self) -> int:
        """Threads per block of the launch."""
        return 32 * decode_warps(self.variant, self.group, self.head_size) if self.kind == "decode" else 128

    def expression(self) -> str:
        """The C++ name of the kernel (a template-id for the templated kernels)."""
        t = CUDA_TYPES[self.dtype]
        if self.kind == "decode":
            if self.variant not in DECODE_KERNELS:
                raise ValueError(f"decode kernel variant: one of {tuple(DECODE_KERNELS)}, got {self.variant!r}")
            args = f"{t}, {self.head_size}, {self.block_size}, {self.group}"
            if self.variant == "base":
                return f"ps_paged_decode<{args}>"  # the template's defaults
            v = DECODE_KERNELS[self.variant]
            warps = decode_warps(self.variant, self.group, self.head_size)
            return f"ps_paged_decode<{args}, {warps}, {v.tile_halves}, {str(v.pipeline).lower()}>"
        if self.kind == "decode_reduce":
            return f"ps_paged_decode_reduce<{t}, {self.head_size}>"
        if self.kind in ("prefill", "prefill_mma"):
            name = "ps_paged_prefill" if self.kind == "prefill" else "ps_paged_prefill_mma"
            args = f"{t}, {self.head_size}, {self.block_size}, {self.group}, {self.tokens}"
            if self.kind == "prefill_mma" and self.variant != "base":
                if self.variant not in PREFILL_MMA_KERNELS:
                    raise ValueError(f"prefill_mma kernel variant: one of {PREFILL_MMA_KERNELS}, got {self.variant!r}")
                return f"{name}<{args}, true>"
            return f"{name}<{args}>"
        raise ValueError(f"kernel kind: no template expression for {self.kind!r}")

    @property
    def source(self) -> str:
        return {"decode": "paged_decode.cu", "decode_reduce": "paged_decode.cu",
                "prefill": "paged_prefill.cu", "prefill_mma": "paged_prefill_mma.cu",
                "cache_ops": "cache_ops.cu"}[self.kind]


@functools.cache
def read_source(name: str, inline_header: bool = True) -> str:
    """A kernel source; with ``inline_header`` the common header is pasted in (for NVRTC)."""
    text = (SRC_DIR / name).read_text()
    if inline_header:
        header = (SRC_DIR / "common.cuh").read_text().replace("#pragma once\n", "")
        text = text.replace('#include "common.cuh"\n', header)
    return text


def nvrtc_options() -> tuple[str, ...]:
    opts = ["--std=c++17"]
    inc = cuda_include_dir()
    if inc is not None:
        opts.append(f"-I{inc}")  # cuda_fp16.h / cuda_bf16.h when NVRTC lacks them built in
    return tuple(opts)


def nvrtc_functions(source_name: str, exprs: dict, device_index: int) -> dict:
    """``exprs`` (key -> a kernel's C++ template-id in ``source_name``) compiled together by NVRTC on
    one device: key -> kernel function. CuPy is imported here: it exists only on GPU machines."""
    import cupy

    with cupy.cuda.Device(device_index):
        mod = cupy.RawModule(code=read_source(source_name), options=nvrtc_options(),
                             name_expressions=list(exprs.values()))
        return {k: mod.get_function(e) for k, e in exprs.items()}


def cuda_include_dir() -> str | None:
    """Where cuda_fp16.h / cuda_bf16.h live: NVRTC (13.x) has no built-in copy of them."""
    roots = [os.environ.get("CUDA_PATH"), os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    cands = [Path(r) / "include" for r in roots if r]
    cands += [Path(p) / "nvidia" / sub / "include" for p in sys.path if p for sub in ("cu13", "cuda_runtime")]
    for inc in cands:
        if (inc / "cuda_bf16.h").is_file():
            return str(inc)
    return None


_MODULES: dict[tuple[KernelKey, int], object] = {}


def precompile(keys: list[KernelKey], device_id: int, chunk: int = 8, workers: int = 8) -> None:
    """Compile many configurations up front: instantiations of one source share an NVRTC
    program (one front-end pass per ``chunk`` of them) and chunks compile in parallel threads."""
    from concurrent.futures import ThreadPoolExecutor

    todo = [k for k in dict.fromkeys(keys) if (k, device_id) not in _MODULES]
    if any(k.kind == "cache_ops" for k in todo):
        get_function(KernelKey("cache_ops"), device_id)
    groups: dict[str, list[KernelKey]] = {}
    for k in todo:
        if k.kind != "cache_ops":
            groups.setdefault(k.source, []).append(k)
    jobs = [(src, ks[i:i + chunk]) for src, ks in groups.items() for i in range(0, len(ks), chunk)]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(lambda job: _compile_group(job[0], job[1], device_id), jobs))


def _compile_group(source: str, keys: list[KernelKey], device_id: int) -> None:
    import cupy

    exprs = [k.expression() for k in keys]
    with cupy.cuda.Device(device_id):
        mod = cupy.RawModule(code=read_source(source), options=nvrtc_options(), name_expressions=exprs)
        for key, expr in zip(keys, exprs, strict=True):
            _MODULES[(key, device_id)] = mod.get_function(expr)


def get_function(key: KernelKey, device_id: int):
    """The compiled kernel for ``key`` on a device (compiled on first use, then cached)."""
    import cupy  # deferred: CuPy is only needed (and only importable) on GPU machines

    cache_key = (key, device_id)
    fn = _MODULES.get(cache_key)
    if fn is None:
        with cupy.cuda.Device(device_id):
            if key.kind == "cache_ops":
                mod = cupy.RawModule(code=read_source(key.source), options=nvrtc_options())
                fn = (mod.get_function("ps_reshape_and_cache"), mod.get_function("ps_copy_blocks"))
            else:
                expr = key.expression()
                mod = cupy.RawModule(code=read_source(key.source), options=nvrtc_options(),
                                     name_expressions=[expr])
                fn = mod.get_function(expr)
        _MODULES[cache_key] = fn
    return fn
