"""Argument checks run before every kernel launch.

A kernel reads raw pointers, so a wrong shape, dtype, stride or alignment would read the wrong
bytes silently. Every check raises ``ValueError`` naming the argument, what was expected and what
was given. They look only at metadata (no device sync), so they run on CPU tensors in CI.
"""

from __future__ import annotations

import torch

from cupy_kernels.build import BLOCK_SIZES, HEAD_SIZES

DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def dtype_name(name: str, t: torch.Tensor) -> str:
    if t.dtype not in DTYPES:
        raise ValueError(f"{name}: dtype must be float32, float16 or bfloat16, got {t.dtype}")
    return DTYPES[t.dtype]


def _aligned(name: str, t: torch.Tensor) -> None:
    if t.data_ptr() % 16:
        raise ValueError(f"{name}: data must be 16-byte aligned for vector loads (address {t.data_ptr():#x})")


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """``[num_blocks, block_size, num_kv_heads, head_size]`` contiguous, K and V alike."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4:
            raise ValueError(f"{name}: expected [num_blocks, block_size, num_kv_heads, head_size], "
                             f"got shape {tuple(c.shape)}")
        if not c.is_contiguous():
            raise ValueError(f"{name}: must be contiguous, got strides {c.stride()}")
        dtype_name(name, c)
        _aligned(name, c)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype or v_cache.device != k_cache.device:
        raise ValueError(f"v_cache: must match k_cache ({tuple(k_cache.shape)}, {k_cache.dtype}, "
                         f"{k_cache.device}), got ({tuple(v_cache.shape)}, {v_cache.dtype}, {v_cache.device})")
    _, block_size, _, head_size = k_cache.shape
    if head_size not in HEAD_SIZES:
        raise ValueError(f"k_cache: head_size must be one of {HEAD_SIZES}, got {head_size}")
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"k_cache: block_size must be one of {BLOCK_SIZES}, got {block_size}")
    return tuple(k_cache.shape)  # type: ignore[return-value]


def check_rows(name: str, t: torch.Tensor, heads: int, head_size: int, dtype: torch.dtype,
               num_rows: int | None = None) -> None:
    """``[num_rows, heads, head_size]`` with the two inner dims contiguous; the row stride may be
    larger (a slice of a fused QKV projection) but must keep rows 16-byte aligned."""
    if t.dim() != 3 or t.shape[1] != heads or t.shape[2] != head_size:
        raise ValueError(f"{name}: expected shape [n, {heads}, {head_size}], got {tuple(t.shape)}")
    if num_rows is not None and t.shape[0] != num_rows:
        raise ValueError(f"{name}: expected {num_rows} rows, got {t.shape[0]}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: dtype must be {dtype} (the cache dtype), got {t.dtype}")
    if t.stride(2) != 1 or t.stride(1) != head_size:
        raise ValueError(f"{name}: the [heads, head_size] part must be contiguous, got strides {t.stride()}")
    if t.shape[0] > 1 and (t.stride(0) * t.element_size()) % 16:
        raise ValueError(f"{name}: row stride {t.stride(0)} elements is not a multiple of 16 bytes")
    _aligned(name, t)


def check_index(name: str, t: torch.Tensor, dtype: torch.dtype, shape: tuple[int | None, ...]) -> None:
    """An integer metadata tensor: exact dtype, contiguous, shape (None = any extent)."""
    if t.dtype != dtype:
        raise ValueError(f"{name}: dtype must be {dtype}, got {t.dtype}")
    if t.dim() != len(shape) or any(s is not None and s != d for s, d in zip(shape, t.shape, strict=True)):
        want = ", ".join("n" if s is None else str(s) for s in shape)
        raise ValueError(f"{name}: expected shape [{want}], got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, got strides {t.stride()}")


def check_device(device: torch.device, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.device != device:
            raise ValueError(f"{name}: must be on {device} with the cache, got {t.device}")


def check_heads(num_q_heads: int, num_kv_heads: int) -> int:
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(f"query: num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    return num_q_heads // num_kv_heads


def check_pairs(name: str, pairs: list[tuple[int, int]], num_src: int, num_dst: int, distinct: bool) -> None:
    """Block pairs (src, dst) in range; with ``distinct`` no destination repeats or is also a
    source, so one launch can copy them all in any order."""
    for src, dst in pairs:
        if not (0 <= src < num_src and 0 <= dst < num_dst):
            raise ValueError(f"{name}: pair ({src}, {dst}) out of range: source blocks [0, {num_src}), "
                             f"destination blocks [0, {num_dst})")
    if distinct:
        dsts = [d for _, d in pairs]
        if len(set(dsts)) != len(dsts):
            raise ValueError(f"{name}: a destination block appears twice: {sorted(dsts)}")
        both = set(dsts) & {s for s, _ in pairs}
        if both:
            raise ValueError(f"{name}: blocks {sorted(both)} are both a source and a destination")
