"""CI compile check of the CUDA kernels (no GPU needed, nvcc is part of the toolchain).

Compiles every .cu file with ``nvcc -cubin -Xptxas -v`` for sm_80 and sm_90 over a representative
set of template instantiations (every dtype and head size, every block size, q-head groups from
MHA to MQA), from the exact text NVRTC compiles at run time (common.cuh pasted in), and fails on
a compile error, a register spill or a stack frame. Every decode kernel variant
(``build.DECODE_KERNELS``) compiles over the same instantiations as the base kernel, each variant its
own unit, and so does the cp.async-pipelined tensor-core prefill (``build.PREFILL_MMA_KERNELS``).
Units compile in parallel. The same instantiations then go through NVRTC itself (ctypes, the nvidia-cuda-nvrtc wheel) with CuPy's
kind of request: the run-time options and one name expression per kernel.
"""

from __future__ import annotations

import dataclasses
import itertools
import re
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from cupy_kernels.build import (
    BLOCK_SIZES,
    CUDA_TYPES,
    DECODE_KERNELS,
    HEAD_SIZES,
    MMA_DTYPES,
    MMA_HEAD_SIZES,
    PREFILL_MMA_KERNELS,
    SOURCES,
    KernelKey,
    nvrtc_options,
    prefill_mma_tokens,
    prefill_tokens,
    read_source,
)
from testing.kernels.nvcc import find_nvcc
from testing.kernels.nvrtc import compile_source, find_library

ARCHS = ("sm_80", "sm_90")
GROUPS = (4, 1, 8, 2, 7, 3)  # cycled; the Llama-3-8B decode shape (bf16, 128, 16, 4) is in the set
_ENTRY = re.compile(r"Compiling entry function '(\w+)'.*?\n(.*?)Used (\d+) registers", re.S)
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def representative_keys() -> dict[str, list[KernelKey]]:
    combos = list(itertools.product(CUDA_TYPES, HEAD_SIZES))  # 15 (dtype, head size) pairs
    decode, prefill, reduce = [], [], []
    for i, (dtype, head) in enumerate(combos):
        bs = BLOCK_SIZES[(i + 1) % len(BLOCK_SIZES)]
        g_dec, g_pre = GROUPS[i % len(GROUPS)], GROUPS[(i + 3) % len(GROUPS)]
        decode.append(KernelKey("decode", dtype, head, bs, g_dec))
        prefill.append(KernelKey("prefill", dtype, head, bs, g_pre, prefill_tokens(g_pre)))
        reduce.append(KernelKey("decode_reduce", dtype, head))
    # Tensor-core prefill: every (f16/bf16, head size) pair, group sizes cycled (64 / g tokens a tile).
    mma = [KernelKey("prefill_mma", dtype, head, BLOCK_SIZES[i % len(BLOCK_SIZES)], g, prefill_mma_tokens(g))
           for i, (dtype, head) in enumerate(itertools.product(MMA_DTYPES, MMA_HEAD_SIZES))
           for g in [GROUPS[i % len(GROUPS)]]]
    return {"paged_decode.cu": decode + reduce, "paged_prefill.cu": prefill, "paged_prefill_mma.cu": mma,
            "cache_ops.cu": []}


def variant_keys() -> dict[tuple[str, str], list[KernelKey]]:
    """(source, variant) -> each kernel variant but "base" over the base kernel's representative
    instantiations: the decode variants (the 8-warp ones meet the shared-memory fallback at head 256 x
    group 8) and the pipelined tensor-core prefill (64-token stages to head 80, 32-token ones above)."""
    keys = representative_keys()
    decode = [k for k in keys["paged_decode.cu"] if k.kind == "decode"]
    out = {("paged_decode.cu", v): [dataclasses.replace(k, variant=v) for k in decode]
           for v in DECODE_KERNELS if v != "base"}
    out |= {("paged_prefill_mma.cu", v): [dataclasses.replace(k, variant=v) for k in keys["paged_prefill_mma.cu"]]
            for v in PREFILL_MMA_KERNELS if v != "base"}
    return out


def _compile(nvcc: str, workdir: Path, source: str, keys: list[KernelKey], arch: str, tag: str = "") -> tuple[str, str]:
    src = workdir / f"nvrtc_{source}"  # the NVRTC text: header pasted, no include path needed
    if not src.exists():
        src.write_text(read_source(source))
    unit = workdir / f"unit_{arch}_{tag}{source}"
    unit.write_text(_unit_text(src.name, keys))
    proc = subprocess.run([nvcc, "-cubin", f"-arch={arch}", "-std=c++17", "-Xptxas", "-v", "-I", str(workdir),
                           "-o", str(unit.with_suffix(".cubin")), str(unit)],
                          capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        pytest.fail(f"nvcc failed for {source} ({arch}):\n{proc.stderr[-4000:]}")
    return f"{source} {tag}{arch}", proc.stderr


def _unit_text(include: str, keys: list[KernelKey]) -> str:
    lines = [f'#include "{include}"', "void* ps_instances[] = {nullptr,"]
    lines += [f"    (void*)&{k.expression()}," for k in keys]
    return "\n".join([*lines, "};", ""])


def _parse(report: str) -> list[tuple[str, int, int, int, int]]:
    """(function, stack bytes, spill stores, spill loads, registers) per compiled entry."""
    rows = []
    for name, body, regs in _ENTRY.findall(report):
        frame = _FRAME.search(body)
        if frame is None:
            raise AssertionError(f"no stack/spill line for {name} in ptxas output")
        rows.append((name, int(frame.group(1)), int(frame.group(2)), int(frame.group(3)), int(regs)))
    return rows


def test_sources_use_no_host_headers():
    """NVRTC has no host C++ library: only the CUDA half/bfloat16 headers may be included."""
    for name in SOURCES:
        for inc in re.findall(r'#include\s*[<"]([^>"]+)[>"]', read_source(name)):
            assert inc in ("cuda_fp16.h", "cuda_bf16.h"), f"{name} includes {inc}"


def test_kernels_compile_without_spills(tmp_path):
    nvcc = find_nvcc()
    assert nvcc is not None, "nvcc not found on PATH or in /usr/local/cuda/bin: it is part of the toolchain"
    jobs = [(src, keys, arch, "") for src, keys in representative_keys().items() for arch in ARCHS]
    jobs += [(src, keys, arch, f"{v}_") for (src, v), keys in variant_keys().items() for arch in ARCHS]
    for src in {j[0] for j in jobs}:  # written once, before the threads race to it
        (tmp_path / f"nvrtc_{src}").write_text(read_source(src))
    with ThreadPoolExecutor(max_workers=4) as pool:
        reports = list(pool.map(lambda j: _compile(nvcc, tmp_path, *j), jobs))
    problems, seen = [], 0
    for label, report in reports:
        rows = _parse(report)
        seen += len(rows)
        problems += [f"{label} {name}: stack {st} B, spill stores {ss} B, spill loads {sl} B ({regs} regs)"
                     for name, st, ss, sl, regs in rows if st or ss or sl]
    expected = sum(max(1, len(keys)) if src != "cache_ops.cu" else 2
                   for src, keys in representative_keys().items()) * len(ARCHS)
    expected += sum(len(keys) for keys in variant_keys().values()) * len(ARCHS)
    assert seen == expected, f"ptxas reported {seen} kernels, expected {expected}"
    assert not problems, "register spills / local memory:\n" + "\n".join(problems)


def test_nvrtc_compiles_every_name_expression():
    """What CuPy's RawModule does on a GPU machine, minus the device: NVRTC with our options,
    template kernels requested by name expression, a cubin for sm_90."""
    lib = find_library()
    assert lib is not None, "NVRTC library missing: pip install nvidia-cuda-nvrtc (a dev dependency)"
    # CuPy >= 13 with NVRTC >= 12 adds --device-as-default-execution-space; -ftz as its cache does.
    options = [*nvrtc_options(), "--device-as-default-execution-space", "-ftz=true", "--gpu-architecture=sm_90"]

    def run(item):
        source, keys = item
        exprs = [k.expression() for k in keys]
        return source, exprs, compile_source(read_source(source), exprs, options, lib)

    # One instantiation per kernel and dtype: nvcc above covers the rest of the grid.
    subset = {src: [k for k in keys if k.head_size in (80, 128) and (k.head_size == 128) == (k.dtype != "float32")]
              for src, keys in representative_keys().items()}
    subset["paged_prefill_mma.cu"] = [dataclasses.replace(k, variant=v)
                                      for k in representative_keys()["paged_prefill_mma.cu"] if k.head_size in (64, 128)
                                      for v in PREFILL_MMA_KERNELS]
    # Every decode variant at the Llama-3-8B shape and at a float32 one (explicit template arguments)
    subset["paged_decode.cu"] += [KernelKey("decode", d, h, 16, g, variant=v) for v in DECODE_KERNELS if v != "base"
                                  for d, h, g in (("bfloat16", 128, 4), ("float32", 80, 3))]
    with ThreadPoolExecutor(max_workers=3) as pool:
        results = list(pool.map(run, subset.items()))
    for source, exprs, res in results:
        assert res.ok, f"NVRTC failed on {source}:\n{res.log[-4000:]}"
        assert set(res.lowered) == set(exprs) and res.cubin_bytes > 0, source
