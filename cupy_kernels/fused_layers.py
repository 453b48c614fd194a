"""Launchers for the fused decoder layers in ``fused_layers.cu``: RMSNorm with the residual add,
SiLU-and-mul, and RoPE with the KV-cache write.

As in :mod:`cupy_kernels.launchers`, arguments are checked first (``ValueError`` naming the
argument; the checks read metadata only, so the CPU emulator in tests runs them too), then the
kernel runs on torch's current stream over torch's memory in place. Each kernel is a template on
the storage type; one NVRTC module holds the three kernels of a dtype.
"""

from __future__ import annotations

import numpy as np
import torch

from cupy_kernels import checks
from cupy_kernels.build import CUDA_TYPES, nvrtc_functions
from cupy_kernels.launchers import _on_torch_stream, _ptr, _require_cuda

SOURCE = "fused_layers.cu"
THREADS = 256  # PS_FUSED_THREADS
KERNELS = ("ps_add_rms_norm", "ps_silu_and_mul", "ps_rope_and_cache")


def expression(kernel: str, dtype: str) -> str:
    """The C++ template-id of ``kernel`` for a storage dtype (a key of CUDA_TYPES)."""
    if kernel not in KERNELS:
        raise ValueError(f"kernel: one of {KERNELS}, got {kernel!r}")
    return f"{kernel}<{CUDA_TYPES[dtype]}>"


def _rows(name: str, t: torch.Tensor, width: int, dtype: torch.dtype, rows: int | None = None) -> None:
    if t.dim() != 2 or t.shape[1] != width or (rows is not None and t.shape[0] != rows):
        want = f"[{'n' if rows is None else rows}, {width}]"
        raise ValueError(f"{name}: expected shape {want}, got {tuple(t.shape)}")
    if t.dtype != dtype:
        raise ValueError(f"{name}: dtype must be {dtype}, got {t.dtype}")
    if not t.is_contiguous():
        raise ValueError(f"{name}: must be contiguous, got strides {t.stride()}")


def check_add_rms_norm(out: torch.Tensor, residual: torch.Tensor, delta: torch.Tensor | None,
                       weight: torch.Tensor) -> None:
    checks.dtype_name("residual", residual)
    n, hidden = residual.shape if residual.dim() == 2 else (-1, -1)
    _rows("residual", residual, hidden, residual.dtype)
    _rows("out", out, hidden, residual.dtype, n)
    if delta is not None:
        _rows("delta", delta, hidden, residual.dtype, n)
    if weight.shape != (hidden,) or weight.dtype != residual.dtype or not weight.is_contiguous():
        raise ValueError(f"weight: expected a contiguous [{hidden}] {residual.dtype} tensor, "
                         f"got {tuple(weight.shape)} {weight.dtype}")
    if out.data_ptr() == residual.data_ptr():
        raise ValueError("out: must not alias residual (the second pass re-reads it)")


def check_silu_and_mul(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    checks.dtype_name("gate_up", gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"gate_up: expected [n, 2 * intermediate], got {tuple(gate_up.shape)}")
    _rows("gate_up", gate_up, gate_up.shape[1], gate_up.dtype)
    _rows("out", out, gate_up.shape[1] // 2, gate_up.dtype, gate_up.shape[0])


def check_rope_and_cache(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                         k_cache: torch.Tensor, v_cache: torch.Tensor, positions: torch.Tensor,
                         slot_mapping: torch.Tensor, inv_freq: torch.Tensor) -> None:
    _, _, num_kv_heads, head = checks.check_cache_pair(k_cache, v_cache)
    checks.check_index("positions", positions, torch.int64, (None,))
    n = positions.shape[0]
    checks.check_index("slot_mapping", slot_mapping, torch.int64, (n,))
    checks.check_index("inv_freq", inv_freq, torch.float32, (head // 2,))
    checks.check_rows("query", query, query.shape[1] if query.dim() == 3 else -1, head, k_cache.dtype, n)
    checks.check_rows("key", key, num_kv_heads, head, k_cache.dtype, n)
    checks.check_rows("value", value, num_kv_heads, head, k_cache.dtype, n)
    if n > 1 and key.stride(0) != value.stride(0):
        raise ValueError(f"value: row stride must equal key's ({key.stride(0)}), got {value.stride(0)}")


_MODULES: dict[tuple[str, int], dict[str, object]] = {}


def _functions(dtype: str, device_index: int) -> dict[str, object]:
    """The three kernels of a dtype on a device, compiled by NVRTC on first use."""
    fns = _MODULES.get((dtype, device_index))
    if fns is None:
        exprs = {k: expression(k, dtype) for k in KERNELS}
        fns = _MODULES[(dtype, device_index)] = nvrtc_functions(SOURCE, exprs, device_index)
    return fns


def add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """``residual += delta`` (in place, unless delta is None), then ``out = weight * rms_norm(residual)``
    for rows ``[n, hidden]``. Returns out."""
    out = torch.empty_like(residual) if out is None else out
    tensors = {"residual": residual, "out": out, "weight": weight}
    device = _require_cuda(**tensors, **({"delta": delta} if delta is not None else {}))
    check_add_rms_norm(out, residual, delta, weight)
    if residual.shape[0] == 0:
        return out
    with _on_torch_stream(device) as dev:
        fn = _functions(checks.DTYPES[residual.dtype], dev)["ps_add_rms_norm"]
        fn((residual.shape[0],), (THREADS,), (
            _ptr(out), _ptr(residual), np.uint64(0) if delta is None else _ptr(delta), _ptr(weight),
            np.int32(residual.shape[1]), np.float32(eps)))
    return out


def silu_and_mul(gate_up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[n, 2 * inter]`` -> ``silu(gate) * up`` ``[n, inter]``."""
    n, width = gate_up.shape
    out = torch.empty((n, width // 2), dtype=gate_up.dtype, device=gate_up.device) if out is None else out
    device = _require_cuda(gate_up=gate_up, out=out)
    check_silu_and_mul(out, gate_up)
    if n == 0:
        return out
    with _on_torch_stream(device) as dev:
        fn = _functions(checks.DTYPES[gate_up.dtype], dev)["ps_silu_and_mul"]
        fn((n,), (THREADS,), (_ptr(out), _ptr(gate_up), np.int32(width // 2)))
    return out


def rope_and_cache(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
                   inv_freq: torch.Tensor) -> None:
    """Rotate query ``[n, q_heads, head]`` and key ``[n, kv_heads, head]`` in place, and write the
    rotated keys and the values to their cache slots (a negative slot writes nothing)."""
    device = _require_cuda(k_cache=k_cache, v_cache=v_cache, query=query, key=key, value=value,
                           positions=positions, slot_mapping=slot_mapping, inv_freq=inv_freq)
    check_rope_and_cache(query, key, value, k_cache, v_cache, positions, slot_mapping, inv_freq)
    n = positions.shape[0]
    if n == 0:
        return
    with _on_torch_stream(device) as dev:
        fn = _functions(checks.DTYPES[k_cache.dtype], dev)["ps_rope_and_cache"]
        fn((n,), (THREADS,), (
            _ptr(query), _ptr(key), _ptr(value), _ptr(k_cache), _ptr(v_cache), _ptr(positions),
            _ptr(slot_mapping), _ptr(inv_freq), np.int64(query.stride(0)), np.int64(key.stride(0)),
            np.int32(query.shape[1]), np.int32(key.shape[1]), np.int32(key.shape[2])))
