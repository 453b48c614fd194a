"""Launchers for the KV-cache maintenance kernels, and swapping between device and host pools.

Like :mod:`cupy_kernels.launchers`: arguments are checked first (``ValueError`` naming the
argument), then the kernel runs on torch's current stream over torch's memory in place.
"""

from __future__ import annotations

import numpy as np
import torch

from cupy_kernels import checks
from cupy_kernels.build import KernelKey, get_function
from cupy_kernels.launchers import _on_torch_stream, _ptr, _require_cuda

THREADS = 128
_CACHE_OPS = KernelKey("cache_ops")
MAX_GRID_Y = 65535


def check_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                            v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    _, _, num_kv_heads, head_size = checks.check_cache_pair(k_cache, v_cache)
    checks.check_index("slot_mapping", slot_mapping, torch.int64, (None,))
    n = slot_mapping.shape[0]
    checks.check_rows("key", key, num_kv_heads, head_size, k_cache.dtype, num_rows=n)
    checks.check_rows("value", value, num_kv_heads, head_size, k_cache.dtype, num_rows=n)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write key/value ``[num_tokens, num_kv_heads, head_size]`` into their cache slots
    (``slot_mapping`` int64; a negative slot skips the token). Slots must be < num_blocks *
    block_size (the scheduler's invariant; not checked here, it would need a device sync)."""
    device = _require_cuda(k_cache=k_cache, v_cache=v_cache, key=key, value=value, slot_mapping=slot_mapping)
    check_reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    n = slot_mapping.shape[0]
    if n == 0:
        return
    row_bytes = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
    elem = key.element_size()
    with _on_torch_stream(device) as dev:
        fn = get_function(_CACHE_OPS, dev)[0]
        fn((n,), (THREADS,), (
            _ptr(key), _ptr(value), _ptr(k_cache), _ptr(v_cache), _ptr(slot_mapping),
            np.int64(key.stride(0) * elem // 16), np.int64(value.stride(0) * elem // 16),
            np.int32(row_bytes // 16)))


def _flat_caches(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> list[torch.Tensor]:
    if not caches:
        raise ValueError("caches: expected at least one (k_cache, v_cache) layer")
    shape = caches[0][0].shape
    flat = []
    for i, (k, v) in enumerate(caches):
        try:
            checks.check_cache_pair(k, v)
        except ValueError as exc:
            raise ValueError(f"caches[{i}]: {exc}") from None
        if k.shape != shape or k.dtype != caches[0][0].dtype:
            raise ValueError(f"caches[{i}]: every layer must be {tuple(shape)} {caches[0][0].dtype}, "
                             f"got {tuple(k.shape)} {k.dtype}")
        flat += [k, v]
    return flat


def copy_blocks(caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    """Copy-on-write: ``block[dst] = block[src]`` in every layer's K and V, one launch."""
    flat = _flat_caches(caches)
    checks.check_pairs("pairs", pairs, flat[0].shape[0], flat[0].shape[0], distinct=True)
    if not pairs:
        return
    if len(pairs) > MAX_GRID_Y:
        raise ValueError(f"pairs: at most {MAX_GRID_Y} per call, got {len(pairs)}")
    device = _require_cuda(**{f"caches[{i // 2}]": t for i, t in enumerate(flat)})
    ptrs = torch.tensor([t.data_ptr() for t in flat], dtype=torch.int64).to(device, non_blocking=True)
    pair_t = torch.tensor(pairs, dtype=torch.int64).to(device, non_blocking=True)
    block_vecs = flat[0][0].numel() * flat[0].element_size() // 16
    with _on_torch_stream(device) as dev:
        fn = get_function(_CACHE_OPS, dev)[1]
        fn((len(flat), len(pairs)), (THREADS,), (_ptr(ptrs), _ptr(pair_t), np.int64(block_vecs)))


def _runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """(src, dst, n) runs of consecutive pairs that are consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for src, dst in pairs:
        if runs and runs[-1][0] + runs[-1][2] == src and runs[-1][1] + runs[-1][2] == dst:
            s, d, n = runs[-1]
            runs[-1] = (s, d, n + 1)
        else:
            runs.append((src, dst, 1))
    return runs


def swap_blocks(src_caches: list[tuple[torch.Tensor, torch.Tensor]],
                dst_caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    """``dst_pool[dst] = src_pool[src]`` between the device pool and the host pool (either way).

    Copies are ``cudaMemcpyAsync`` on torch's current stream, one per run of consecutive blocks
    per tensor; they are asynchronous when the host pool is pinned (``pin_memory=True``)."""
    src_flat, dst_flat = _flat_caches(src_caches), _flat_caches(dst_caches)
    if len(src_flat) != len(dst_flat) or src_flat[0].shape[1:] != dst_flat[0].shape[1:] \
            or src_flat[0].dtype != dst_flat[0].dtype:
        raise ValueError(f"dst_caches: {len(dst_flat) // 2} layers of blocks {tuple(dst_flat[0].shape[1:])} "
                         f"{dst_flat[0].dtype} do not match src_caches' {len(src_flat) // 2} layers of "
                         f"{tuple(src_flat[0].shape[1:])} {src_flat[0].dtype}")
    checks.check_pairs("pairs", pairs, src_flat[0].shape[0], dst_flat[0].shape[0], distinct=False)
    for src_t, dst_t in zip(src_flat, dst_flat, strict=True):
        for s, d, n in _runs(pairs):
            dst_t[d:d + n].copy_(src_t[s:s + n], non_blocking=True)
