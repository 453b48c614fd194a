"""Run the CUDA kernel sources on the CPU through the SIMT emulator in ``emu/`` (tests only).

The same ``.cu`` files are compiled with g++ against ``emu/simt.h`` into a shared library with one
C entry point per kernel configuration; launches reuse the GPU launchers' planning
(``plan_decode``/``plan_prefill``), so grids, template choices and argument order are exercised
too. Inputs are CPU torch tensors; outputs are written in place exactly as on the GPU.
"""

from __future__ import annotations

import ctypes
import hashlib
import math
import os
import shutil
import subprocess
import tempfile
import threading
from collections import Counter
from pathlib import Path

import torch

from cupy_kernels import checks
from cupy_kernels.build import CUDA_TYPES, SOURCES, SRC_DIR, KernelKey
from cupy_kernels.launchers import LOG2E, THREADS, plan_decode, plan_prefill

EMU_DIR = Path(__file__).resolve().parent / "emu"
_VOID = ctypes.c_void_p


def _wrapper(i: int, key: KernelKey) -> str:
    t = CUDA_TYPES[key.dtype]
    if key.kind == "decode":
        return f"""
extern "C" void k{i}(unsigned gx, unsigned gy, unsigned gz, void* out, void* po, void* pm, void* ps,
    const void* q, const void* k, const void* v, const int* bt, const int* sl, long long qs, int nkv,
    int qpk, int mb, int psz, float sc) {{
  emu::launch(dim3{{gx, gy, gz}}, {key.threads}, [&] {{ {key.expression()}(({t}*)out, (float*)po, (float*)pm,
      (float*)ps, (const {t}*)q, (const {t}*)k, (const {t}*)v, bt, sl, qs, nkv, qpk, mb, psz, sc); }});
}}"""
    if key.kind == "decode_reduce":
        return f"""
extern "C" void k{i}(unsigned gx, unsigned gy, void* out, const void* po, const void* pm, const void* ps,
    const int* sl, int np, int psz) {{
  emu::launch(dim3{{gx, gy, 1}}, {THREADS}, [&] {{ {key.expression()}(({t}*)out, (const float*)po,
      (const float*)pm, (const float*)ps, sl, np, psz); }});
}}"""
    if key.kind in ("prefill", "prefill_mma"):
        return f"""
extern "C" void k{i}(unsigned gx, unsigned gy, unsigned gz, void* out, const void* q, const void* k,
    const void* v, const int* bt, const int* sl, const int* qsl, long long qs, int nkv, int qpk, int mb,
    float sc) {{
  emu::launch(dim3{{gx, gy, gz}}, {THREADS}, [&] {{ {key.expression()}(({t}*)out, (const {t}*)q,
      (const {t}*)k, (const {t}*)v, bt, sl, qsl, qs, nkv, qpk, mb, sc); }});
}}"""
    raise ValueError(f"kind: no emulator wrapper for {key.kind!r}")


class Emulator:
    """A compiled library for a fixed set of configurations."""

    def __init__(self, keys: list[KernelKey]) -> None:
        self.keys = list(dict.fromkeys(keys))
        self.index = {k: i for i, k in enumerate(self.keys)}
        source = "\n".join([f'#include "{SRC_DIR / s}"' for s in SOURCES]
                           + [_wrapper(i, k) for i, k in enumerate(self.keys)] + [_cache_ops_wrappers()])
        self.lib = ctypes.CDLL(str(_build(source)))

    def _fn(self, key: KernelKey):
        if key not in self.index:
            raise ValueError(f"key: {key} was not compiled into this emulator")
        return getattr(self.lib, f"k{self.index[key]}")

    def decode(self, query, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, out,
               num_partitions: int | None = None, partition_size: int | None = None, variant: str = "auto",
               num_sms: int = 132) -> tuple[int, int]:
        """Runs the launchers' plan; returns the (partitions, partition size) it ran with."""
        launch, parts, psize = plan_decode(query, k_cache, v_cache, block_tables, seq_lens, max_seq_len,
                                           num_sms=num_sms, partition_size=partition_size, variant=variant)
        if num_partitions is not None:
            parts, psize = num_partitions, max(1, math.ceil(max_seq_len / num_partitions))
        n, h, d = query.shape
        po = torch.empty(n, h, parts, d)
        pm, ps = torch.empty(n, h, parts), torch.empty(n, h, parts)
        gx, gy, _ = launch.grid
        self._fn(launch.key)(gx, gy, parts, *_ptrs(out, po, pm, ps, query, k_cache, v_cache, block_tables,
                                                   seq_lens), ctypes.c_longlong(query.stride(0)),
                             k_cache.shape[2], h // k_cache.shape[2], block_tables.shape[1], psize,
                             ctypes.c_float(scale * LOG2E))
        if parts > 1:
            rkey = KernelKey("decode_reduce", launch.key.dtype, d)
            self._fn(rkey)(h, n, *_ptrs(out, po, pm, ps, seq_lens), parts, psize)
        return parts, psize

    def prefill(self, query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                max_seq_len, scale, out, kernel: str = "auto") -> None:
        launch = plan_prefill(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                              max_query_len, max_seq_len, kernel)
        self._fn(launch.key)(*launch.grid, *_ptrs(out, query, k_cache, v_cache, block_tables, seq_lens,
                                                  query_start_loc), ctypes.c_longlong(query.stride(0)),
                             k_cache.shape[2], query.shape[1] // k_cache.shape[2], block_tables.shape[1],
                             ctypes.c_float(scale * LOG2E))

    def reshape_and_cache(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        from cupy_kernels.cache_ops import check_reshape_and_cache

        check_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
        e = key.element_size()
        self.lib.reshape_and_cache(slot_mapping.shape[0], *_ptrs(key, value, k_cache, v_cache, slot_mapping),
                                   ctypes.c_longlong(key.stride(0) * e // 16),
                                   ctypes.c_longlong(value.stride(0) * e // 16),
                                   k_cache.shape[2] * k_cache.shape[3] * e // 16)

    def copy_blocks(self, caches, pairs) -> None:
        flat = [t for kv in caches for t in kv]
        checks.check_pairs("pairs", pairs, flat[0].shape[0], flat[0].shape[0], distinct=True)
        ptrs = torch.tensor([t.data_ptr() for t in flat], dtype=torch.int64)
        pair_t = torch.tensor(pairs, dtype=torch.int64)
        vecs = flat[0][0].numel() * flat[0].element_size() // 16
        self.lib.copy_blocks(len(flat), len(pairs), *_ptrs(ptrs, pair_t), ctypes.c_longlong(vecs))


def emulate_launchers(emu: Emulator, monkeypatch, decode_variant: str = "auto") -> Counter:
    """The CuPy backend's launchers run the kernels' source on the SIMT emulator (one at a time:
    tensor-parallel ranks call them from several threads); decode runs ``decode_variant`` unless a
    caller names one. Returns the count of calls per launcher (``decode``, ``prefill``,
    ``reshape_and_cache``)."""
    from cupy_kernels import cache_ops, launchers

    lock, calls = threading.Lock(), Counter()

    def decode(query, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, out=None, partition_size=None,
               variant=decode_variant):
        out = torch.full_like(query, float("nan")) if out is None else out
        with lock:
            calls["decode"] += 1
            emu.decode(query, k_cache, v_cache, block_tables, seq_lens, max_seq_len, scale, out,
                       partition_size=partition_size, variant=variant)
        return out

    def prefill(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                max_seq_len, scale, out=None, kernel="auto"):
        out = torch.full_like(query, float("nan")) if out is None else out
        with lock:
            calls["prefill"] += 1
            emu.prefill(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                        max_seq_len, scale, out, kernel=kernel)
        return out

    def reshape_and_cache(*args):
        with lock:
            calls["reshape_and_cache"] += 1
            emu.reshape_and_cache(*args)

    monkeypatch.setattr(launchers, "paged_attention_decode", decode)
    monkeypatch.setattr(launchers, "paged_attention_prefill", prefill)
    monkeypatch.setattr(cache_ops, "reshape_and_cache", reshape_and_cache)
    return calls


def _cache_ops_wrappers() -> str:
    return f"""
extern "C" void reshape_and_cache(unsigned n, const void* k, const void* v, void* kc, void* vc,
    const long long* sm, long long ks, long long vs, int rv) {{
  emu::launch(dim3{{n, 1, 1}}, {THREADS}, [&] {{ ps_reshape_and_cache((const uint4*)k, (const uint4*)v,
      (uint4*)kc, (uint4*)vc, sm, ks, vs, rv); }});
}}
extern "C" void copy_blocks(unsigned nc, unsigned np, const void* ptrs, const long long* pairs, long long bv) {{
  emu::launch(dim3{{nc, np, 1}}, {THREADS}, [&] {{ ps_copy_blocks((const unsigned long long*)ptrs, pairs, bv); }});
}}"""


def _ptrs(*tensors: torch.Tensor) -> list[ctypes.c_void_p]:
    return [_VOID(t.data_ptr()) for t in tensors]


def _build(source: str) -> Path:
    """g++ the unit into a shared library, cached by the hash of everything that goes in."""
    inputs = source + "".join((SRC_DIR / s).read_text() for s in (*SOURCES, "common.cuh"))
    inputs += (EMU_DIR / "simt.h").read_text()
    digest = hashlib.sha256(inputs.encode()).hexdigest()[:20]
    cache = Path(os.environ.get("PAGEDSERVE_EMU_CACHE", Path(tempfile.gettempdir()) / "pagedserve-emu"))
    cache.mkdir(parents=True, exist_ok=True)
    lib = cache / f"emu-{digest}.so"
    if lib.exists():
        return lib
    cxx = shutil.which("g++") or shutil.which("c++")
    if cxx is None:
        raise RuntimeError("emulator: no C++ compiler (g++) on PATH")
    with tempfile.TemporaryDirectory() as tmp:
        unit = Path(tmp) / "unit.cpp"
        unit.write_text(source)
        tmp_lib = Path(tmp) / "lib.so"
        proc = subprocess.run([cxx, "-std=c++20", "-O1", "-fPIC", "-shared", "-pthread", "-w", "-x", "c++",
                               f"-I{EMU_DIR}", f"-I{SRC_DIR}", "-o", str(tmp_lib), str(unit)],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(f"emulator build failed:\n{proc.stderr[-4000:]}")
        shutil.move(str(tmp_lib), lib)
    return lib
