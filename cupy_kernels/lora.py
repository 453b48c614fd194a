"""Launchers for the batched LoRA kernels in ``lora.cu`` (Punica-style shrink and expand).

``shrink`` computes ``t[tok, :used] = x[tok] A[slot(tok)]^T`` and ``expand`` adds
``t[tok] B[slot(tok)]^T`` into the output columns ``[lo, hi)`` of the token's slot, for every token
of a step in one launch each, whichever adapter it uses (-1: none). The slot tensors are
``executor_svc/lora/slots.py``'s: A ``[slots, R, in]`` and B^T ``[slots, R, out]`` float32, and
``bounds`` ``[3, slots]`` int32 (used rank rows, first and one-past-last output column per slot).

As in :mod:`cupy_kernels.fused_layers`, arguments are checked first (``ValueError`` naming the
argument; metadata only, so the CPU emulator runs the same checks), then the kernels run on torch's
current stream over torch's memory. Token slots are not range-checked here (that would need a
device sync): ``LoraBatch.build`` checks them on the host, and the kernels skip a slot outside
``[0, slots)`` rather than read out of bounds.
"""

from __future__ import annotations

import numpy as np
import torch

from cupy_kernels import checks
from cupy_kernels.build import CUDA_TYPES, nvrtc_functions
from cupy_kernels.launchers import _on_torch_stream, _ptr, _require_cuda

SOURCE = "lora.cu"
SHRINK_WARPS = 4  # PS_LORA_SHRINK_WARPS: rank rows per shrink block (one warp each)
EXPAND_THREADS = 128  # PS_LORA_EXPAND_THREADS: output columns per expand block
MAX_R = 768  # PS_LORA_MAX_R: rank rows a slot may stack (3 sub-projections x rank 256)
TILE = 8  # PS_LORA_TILE: tokens per block on prefill-sized steps
TILE_FROM = 256  # steps of at least this many tokens take TILE tokens per block (below: one, for the grid)
KERNELS = ("ps_lora_shrink", "ps_lora_expand")


def expression(kernel: str, dtype: str, tokens: int) -> str:
    """The C++ template-id of ``kernel`` for an activation dtype (a key of CUDA_TYPES) and ``tokens`` per
    block (1 or TILE)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: one of {KERNELS}, got {kernel!r}")
    if tokens not in (1, TILE):
        raise ValueError(f"tokens: 1 or {TILE} per block, got {tokens!r}")
    return f"{kernel}<{CUDA_TYPES[dtype]}, {tokens}>"


def tokens_per_block(num_tokens: int) -> int:
    """One token per block for decode-sized steps (the grid needs the blocks); TILE for prefill-sized
    ones, where a tile's tokens mostly share a slot and read its A and B^T once. The threshold is a
    first guess, not yet measured on a GPU."""
    return TILE if num_tokens >= TILE_FROM else 1


def _rows(name: str, t: torch.Tensor, n: int | None, width: int | None) -> None:
    """``[n, width]`` with contiguous rows (the row stride may be larger: a slice of a wider output)."""
    if t.dim() != 2 or (n is not None and t.shape[0] != n) or (width is not None and t.shape[1] != width):
        want = f"[{'n' if n is None else n}, {'width' if width is None else width}]"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    checks.dtype_name(name, t)
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name}: rows must be contiguous, got strides {t.stride()}")


def _stacked(name: str, t: torch.Tensor) -> tuple[int, int, int]:
    """``[slots, R, features]`` float32, contiguous; returns its shape."""
    if t.dim() != 3 or t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous float32 [slots, R, features] tensor, got "
                         f"{tuple(t.shape)} {t.dtype} strides {t.stride()}")
    if t.shape[1] > MAX_R:
        raise ValueError(f"{name}: R = {t.shape[1]} rank rows per slot exceeds the kernels' {MAX_R}")
    return tuple(t.shape)  # type: ignore[return-value]


def check_shrink(t: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bounds: torch.Tensor,
                 token_slots: torch.Tensor) -> None:
    slots, r, n_in = _stacked("a", a)
    checks.check_index("token_slots", token_slots, torch.int32, (None,))
    n = token_slots.shape[0]
    checks.check_index("bounds", bounds, torch.int32, (3, slots))
    _rows("x", x, n, n_in)
    if t.dtype != torch.float32 or tuple(t.shape) != (n, r) or not t.is_contiguous():
        raise ValueError(f"t: expected a contiguous float32 [{n}, {r}] tensor, got {tuple(t.shape)} {t.dtype}")


def check_expand(y: torch.Tensor, t: torch.Tensor, bt: torch.Tensor, bounds: torch.Tensor,
                 token_slots: torch.Tensor, width: int) -> None:
    slots, r, out = _stacked("bt", bt)
    checks.check_index("token_slots", token_slots, torch.int32, (None,))
    n = token_slots.shape[0]
    checks.check_index("bounds", bounds, torch.int32, (3, slots))
    _rows("y", y, n, out)
    if t.dtype != torch.float32 or tuple(t.shape) != (n, r) or not t.is_contiguous():
        raise ValueError(f"t: expected a contiguous float32 [{n}, {r}] tensor, got {tuple(t.shape)} {t.dtype}")
    if not isinstance(width, int) or not 0 <= width <= out:
        raise ValueError(f"width: the widest slot's output range, in [0, {out}], got {width!r}")


def shrink_grid(num_tokens: int, r: int, tokens: int) -> tuple[int, int, int]:
    return -(-num_tokens // tokens), -(-r // SHRINK_WARPS), 1


def expand_grid(num_tokens: int, width: int, tokens: int) -> tuple[int, int, int]:
    return -(-num_tokens // tokens), -(-width // EXPAND_THREADS), 1


_MODULES: dict[tuple[str, int], dict[tuple[str, int], object]] = {}


def _functions(dtype: str, device_index: int) -> dict[tuple[str, int], object]:
    """Both kernels of an activation dtype, at both tile sizes, on a device (NVRTC, on first use)."""
    fns = _MODULES.get((dtype, device_index))
    if fns is None:
        exprs = {(k, n): expression(k, dtype, n) for k in KERNELS for n in (1, TILE)}
        fns = _MODULES[(dtype, device_index)] = nvrtc_functions(SOURCE, exprs, device_index)
    return fns


def shrink(t: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bounds: torch.Tensor,
           token_slots: torch.Tensor, tokens: int | None = None) -> torch.Tensor:
    """``t[tok, :used] = x[tok] a[slot]^T`` (float32) for every token with a slot; returns t.
    ``tokens``: per block (default :func:`tokens_per_block`; tests force each)."""
    device = _require_cuda(t=t, x=x, a=a, bounds=bounds, token_slots=token_slots)
    check_shrink(t, x, a, bounds, token_slots)
    if tokens is not None:
        expression("ps_lora_shrink", "float32", tokens)  # (ValueError naming tokens)
    n, (slots, r, n_in) = token_slots.shape[0], a.shape
    if n == 0 or r == 0:
        return t
    tokens = tokens_per_block(n) if tokens is None else tokens
    with _on_torch_stream(device) as dev:
        fn = _functions(checks.DTYPES[x.dtype], dev)[("ps_lora_shrink", tokens)]
        fn(shrink_grid(n, r, tokens), (SHRINK_WARPS * 32,), (
            _ptr(t), _ptr(x), _ptr(a), _ptr(bounds), _ptr(token_slots), np.int64(x.stride(0)), np.int32(n),
            np.int32(slots), np.int32(r), np.int32(n_in)))
    return t


def expand(y: torch.Tensor, t: torch.Tensor, bt: torch.Tensor, bounds: torch.Tensor,
           token_slots: torch.Tensor, width: int | None = None, tokens: int | None = None) -> torch.Tensor:
    """``y[tok, lo:hi] += t[tok, :used] bt[slot, :used, lo:hi]`` in place (float32 sum, rounded once
    to y's dtype). ``width``: the widest ``hi - lo`` of the slots in the step (default: y's width),
    which sizes the grid; ``tokens`` as for :func:`shrink`. Returns y."""
    device = _require_cuda(y=y, t=t, bt=bt, bounds=bounds, token_slots=token_slots)
    width = bt.shape[2] if width is None else width
    check_expand(y, t, bt, bounds, token_slots, width)
    if tokens is not None:
        expression("ps_lora_expand", "float32", tokens)
    n, (slots, r, out) = token_slots.shape[0], bt.shape
    if n == 0 or width == 0:
        return y
    tokens = tokens_per_block(n) if tokens is None else tokens
    with _on_torch_stream(device) as dev:
        fn = _functions(checks.DTYPES[y.dtype], dev)[("ps_lora_expand", tokens)]
        fn(expand_grid(n, width, tokens), (EXPAND_THREADS,), (
            _ptr(y), _ptr(t), _ptr(bt), _ptr(bounds), _ptr(token_slots), np.int64(y.stride(0)), np.int32(n),
            np.int32(slots), np.int32(r), np.int32(out)))
    return y
