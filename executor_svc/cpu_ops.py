"""ctypes bindings of the CPU kernels' linear layers, fused decode stack and bandwidth probe.

The library is the one :mod:`executor_svc.cpu_kernels` builds from ``csrc/*.c``. The
structures mirror ``csrc/ps_cpu.h`` and ``csrc/decode_stack_cpu.c`` field for field; every call
passes raw pointers, so the callers (``executor_svc/model/weights.py``,
``executor_svc/model/cpu_decode.py``) keep the tensors they point into alive and check shapes
and dtypes once, when they build a descriptor. ctypes releases the GIL for a call's duration:
the executor's heartbeat thread keeps running during a step.
"""

from __future__ import annotations

import ctypes
import functools
import logging

import torch

from executor_svc.cpu_kernels import build_library, load_decode_kernel, open_library

log = logging.getLogger(__name__)

W_F32, W_BF16, W_Q8, W_Q8_0, W_Q4_0, W_Q4_1, W_Q4_K = 0, 1, 2, 3, 4, 5, 6  # PS_W_* in csrc/ps_cpu.h
ISA_NAMES = {0: "scalar", 1: "avx2", 2: "avx512"}
_STATUS = {1: "a block id or cache slot outside the cache", 2: "a seq_len < 1 or longer than its block table",
           3: "a work buffer too small or out of memory", 4: "a shape or type the kernel does not take"}

c_i32, c_i64, c_ptr, c_f32 = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class LinearDesc(ctypes.Structure):
    _fields_ = [("w", c_ptr), ("scale", c_ptr), ("wsum", c_ptr), ("bias", c_ptr), ("ldw", c_i64),
                ("m", c_i32), ("k", c_i32), ("wtype", c_i32), ("reserved", c_i32)]


class LoraDesc(ctypes.Structure):  # ps_lora_t: one projection's adapter slots (executor_svc/lora/slots.py)
    _fields_ = [("a", c_ptr), ("bt", c_ptr), ("segs", c_ptr), ("slots", c_i32), ("rows", c_i32), ("in_", c_i32),
                ("out", c_i32), ("dtype", c_i32), ("reserved", c_i32)]


class LayerDesc(ctypes.Structure):
    _fields_ = [("qkv", LinearDesc), ("o", LinearDesc), ("gate_up", LinearDesc), ("down", LinearDesc),
                ("ln1", c_ptr), ("ln2", c_ptr), ("k_cache", c_ptr), ("v_cache", c_ptr),
                ("lora_qkv", LoraDesc), ("lora_o", LoraDesc), ("lora_gate_up", LoraDesc), ("lora_down", LoraDesc)]


class ModelDesc(ctypes.Structure):
    _fields_ = [("num_layers", c_i32), ("hidden", c_i32), ("num_heads", c_i32), ("num_kv_heads", c_i32),
                ("head_dim", c_i32), ("intermediate", c_i32), ("block_size", c_i32), ("kv_type", c_i32),
                ("num_blocks", c_i64), ("eps", c_f32), ("attn_scale", c_f32),
                ("layers", ctypes.POINTER(LayerDesc)), ("inv_freq", c_ptr), ("final_norm", c_ptr),
                ("lm_head", LinearDesc), ("token_lora", c_ptr), ("lora_order", c_ptr)]


def check_status(what: str, status: int) -> None:
    if status:
        raise ValueError(f"{what}: {_STATUS.get(status, f'status {status}')}")


class CpuOps:
    """The library's entry points with their argument types."""

    def __init__(self, lib: ctypes.CDLL, description: str = "") -> None:
        self.lib, self.description = lib, description
        lib.ps_cpu_features.restype = c_i32
        lib.ps_set_isa_limit.argtypes = [c_i32]
        lib.ps_set_isa_limit.restype = c_i32
        lib.ps_isa_level.argtypes = [c_i32]
        lib.ps_isa_level.restype = c_i32
        lib.ps_linear_work_bytes.argtypes = [c_i32, c_i32, c_i32]
        lib.ps_linear_work_bytes.restype = c_i64
        lib.ps_linear.argtypes = [ctypes.POINTER(LinearDesc), c_ptr, c_i64, c_i32, c_ptr, c_i64, c_i32, c_ptr,
                                  c_i64, c_i32]
        lib.ps_linear.restype = c_i32
        lib.ps_blocks_rows.argtypes = [ctypes.POINTER(LinearDesc), c_ptr, c_i32, c_ptr, c_i64]
        lib.ps_blocks_rows.restype = c_i32
        lib.ps_stack_work_bytes.argtypes = [ctypes.POINTER(ModelDesc), c_i32, c_i32]
        lib.ps_stack_work_bytes.restype = c_i64
        lib.ps_decode_stack.argtypes = [ctypes.POINTER(ModelDesc), c_ptr, c_i32, c_ptr, c_ptr, c_ptr, c_i64, c_i32,
                                        c_ptr, c_ptr, c_ptr, c_i64, c_i32, c_i32]
        lib.ps_decode_stack.restype = c_i32
        lib.ps_read_sum.argtypes = [c_ptr, c_i64, c_i32]
        lib.ps_read_sum.restype = ctypes.c_double
        lib.ps_rms_norm_rows.argtypes = [c_ptr, c_i64, c_i32, c_ptr, c_i32, c_f32, c_ptr, c_i64, c_i32]
        lib.ps_rms_norm_rows.restype = None
        lib.ps_rope_cos_sin_rows.argtypes = [c_ptr, c_i32, c_ptr, c_i32, c_ptr, c_ptr]
        lib.ps_rope_cos_sin_rows.restype = None
        lib.ps_rope_rows.argtypes = [c_ptr, c_i64, c_i32, c_i32, c_i32, c_ptr, c_ptr, c_i32]
        lib.ps_rope_rows.restype = None
        lib.ps_silu_mul_rows.argtypes = [c_ptr, c_i64, c_i32, c_i32, c_ptr, c_i64, c_i32]
        lib.ps_silu_mul_rows.restype = None
        self._work = torch.empty(0, dtype=torch.uint8)  # activation scratch of linear(), grown on demand

    # ---------------------------------------------------------------- features

    def features(self) -> dict[str, bool]:
        f = self.lib.ps_cpu_features()
        return {"avx2": bool(f & 1), "avx512": bool(f & 2), "avx512_bf16": bool(f & 4), "avx512_vnni": bool(f & 8)}

    def isa(self, wtype: int) -> str:
        """The instruction set the kernels of a weight type use on this CPU (``ISA_NAMES``)."""
        return ISA_NAMES[self.lib.ps_isa_level(wtype)]

    def limit_isa(self, level: str) -> None:
        """Use at most ``level`` (scalar, avx2, avx512) from now on (tests, benchmarks)."""
        codes = {v: k for k, v in ISA_NAMES.items()}
        if level not in codes:
            raise ValueError(f"isa level: expected one of {sorted(codes)}, got {level!r}")
        self.lib.ps_set_isa_limit(codes[level])

    # ---------------------------------------------------------------- calls

    def work(self, nbytes: int) -> torch.Tensor:
        """A scratch buffer of at least ``nbytes`` (shared by successive calls on one thread)."""
        if self._work.numel() < nbytes:
            self._work = torch.empty(max(nbytes, 2 * self._work.numel()), dtype=torch.uint8)
        return self._work

    def linear(self, desc: LinearDesc, x: torch.Tensor, y: torch.Tensor, threads: int, accumulate: bool = False) -> None:
        """y [n, m] (+)= x [n, k] @ W^T: x and y float32 with unit column stride (checked by the caller)."""
        n = x.shape[0]
        nbytes = self.lib.ps_linear_work_bytes(desc.wtype, n, desc.k)
        work = self.work(nbytes)
        check_status("linear", self.lib.ps_linear(ctypes.byref(desc), x.data_ptr(), x.stride(0), n, y.data_ptr(),
                                                  y.stride(0), int(accumulate), work.data_ptr(), work.numel(),
                                                  threads))

    # Row-wise operations (csrc/rowwise_cpu.c): the decode stack's own functions, so the modules
    # compute what it computes. Arguments: float32 CPU tensors whose last dimension is contiguous.

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x [n, d] -> w * x / rms(x) [n, d]."""
        n, d = x.shape
        _rows_ok(x, weight)
        out = torch.empty(n, d, dtype=torch.float32)
        self.lib.ps_rms_norm_rows(x.data_ptr(), x.stride(0), n, weight.data_ptr(), d, eps, out.data_ptr(), d,
                                  torch.get_num_threads())
        return out

    def rope_tables(self, positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [n] int64 -> cos, sin [n, head_dim / 2] float32."""
        n, half = positions.shape[0], inv_freq.shape[0]
        if positions.dtype != torch.int64 or not positions.is_contiguous():
            positions = positions.to(torch.int64).contiguous()
        _rows_ok(inv_freq)
        cos, sin = torch.empty(n, half), torch.empty(n, half)
        self.lib.ps_rope_cos_sin_rows(positions.data_ptr(), n, inv_freq.data_ptr(), half, cos.data_ptr(),
                                      sin.data_ptr())
        return cos, sin

    def rope(self, x: torch.Tensor, heads: int, head_dim: int, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotates the first ``heads`` heads of each row of x [n, >= heads * head_dim] in place."""
        n = x.shape[0]
        _rows_ok(x, cos, sin)
        if x.shape[1] < heads * head_dim or cos.shape != sin.shape or tuple(cos.shape) != (n, head_dim // 2) \
                or not (cos.is_contiguous() and sin.is_contiguous()):
            raise ValueError(f"rope: {tuple(x.shape)} rows, {heads} heads of {head_dim}, tables {tuple(cos.shape)}")
        self.lib.ps_rope_rows(x.data_ptr(), x.stride(0), n, heads, head_dim, cos.data_ptr(), sin.data_ptr(),
                              torch.get_num_threads())

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gate_up [n, 2 d] -> SiLU(gate) * up [n, d]."""
        n, d = gate_up.shape[0], gate_up.shape[1] // 2
        _rows_ok(gate_up)
        out = torch.empty(n, d, dtype=torch.float32)
        self.lib.ps_silu_mul_rows(gate_up.data_ptr(), gate_up.stride(0), n, d, out.data_ptr(), d,
                                  torch.get_num_threads())
        return out

    def read_bandwidth(self, nbytes: int, threads: int, repeats: int = 5) -> float:
        """Bytes per second of a STREAM-style read of ``nbytes`` of float32 (best of ``repeats``)."""
        import time

        a = torch.ones(nbytes // 4, dtype=torch.float32)
        best = float("inf")
        for _ in range(repeats + 1):  # the first pass also faults the pages in
            t0 = time.perf_counter()
            self.lib.ps_read_sum(a.data_ptr(), a.numel(), threads)
            best = min(best, time.perf_counter() - t0)
        return a.numel() * 4 / best


def _rows_ok(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.dtype != torch.float32 or t.device.type != "cpu" or t.stride(-1) != 1:
            raise ValueError(f"row-wise kernels take float32 CPU rows with a contiguous last dimension, "
                             f"got {t.dtype} {t.device} strides {t.stride()}")


@functools.cache
def load_cpu_ops() -> CpuOps | None:
    """The kernels' library, built or found on first use (as the attention kernel's); None when it
    does not load (one warning, from :func:`executor_svc.cpu_kernels.load_decode_kernel`)."""
    kernel = load_decode_kernel()
    if kernel is None:
        return None
    return CpuOps(kernel.lib, str(kernel.build.path))


def native_ops() -> CpuOps:
    """The ``-march=native`` build, compiled if needed; raises when it cannot be (tests, benchmarks)."""
    build = build_library("native")
    return CpuOps(open_library(build), str(build.path))
