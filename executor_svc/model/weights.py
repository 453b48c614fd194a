"""Weight formats of the CPU executor: linear layers in float32, bfloat16 or int8, computed by C.

``pack_for_cpu`` turns a loaded float model into one whose linear layers (the fused q/k/v,
o, gate/up and down projections, the LM head) and token embedding hold their weights in one
format and run through the kernels of ``executor_svc/csrc/linear_cpu.c``:

* ``float32``: the checkpoint's weights as they are (token-exact against transformers).
* ``bfloat16``: each weight rounded to bfloat16 (half the bytes a step reads).
* ``int8``: symmetric per output channel, as vLLM's W8 schemes: ``scale[o] = max|W[o]| / 127``,
  ``q = round(W / scale)`` in [-127, 127] (a quarter of the bytes). The kernels quantise
  each token's activations to int8 on the fly for the integer dot products (as llama.cpp's
  Q8_0 does), so no calibration data is needed.

Activations, norms, the residual stream and logits stay float32 in every format; RMSNorm
weights are kept in float32. Every row count runs on the C kernels, prefills included: they
reduce each row in one order whatever the rows beside it, so a token's result does not depend
on how its step was made up (a prefix cache hit, a chunk, neighbours); oneDNN, faster on large
float32 GEMMs, blocks its sums by the row count ("What a seed guarantees", docs/ARCHITECTURE.md).
Where the C library is unavailable the same formats run on torch (oneDNN or ``F.linear``,
``torch.ops.aten._weight_int8pack_mm``): slower, same weights, no such guarantee.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.cpu_ops import W_BF16, W_F32, W_Q8, CpuOps, LinearDesc

FORMATS = ("float32", "bfloat16", "int8")
_WTYPE = {"float32": W_F32, "bfloat16": W_BF16, "int8": W_Q8}


def _onednn_linear():
    """torch's oneDNN linear (``mkldnn::_linear_pointwise``, inductor's), the float32 path when the
    C library is unavailable; None where this torch has no oneDNN: F.linear (MKL or OpenBLAS) then."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise.default
    except (AttributeError, RuntimeError):
        return None


ONEDNN_LINEAR = _onednn_linear()


PANEL, UNIT = 16, 64  # outputs per panel and per unit of work (csrc/ps_cpu.h)
GROUP = {"bfloat16": 2, "int8": 4}  # inputs interleaved per output in a panel


def _pad_to(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pack_panels(weight: torch.Tensor, group: int) -> torch.Tensor:
    """[m, k] -> the C kernels' panel layout [mp / 16, kp / group, 16, group] (zero padded):
    64 bytes hold 16 outputs x ``group`` inputs, so one vector load feeds 16 outputs."""
    m, k = weight.shape
    mp, kp = _pad_to(m, UNIT), _pad_to(k, group)
    padded = torch.zeros(mp, kp, dtype=weight.dtype)
    padded[:m, :k] = weight
    return padded.view(mp // PANEL, PANEL, kp // group, group).permute(0, 2, 1, 3).contiguous()


def unpack_rows(packed: torch.Tensor, ids: torch.Tensor, k: int) -> torch.Tensor:
    """Rows ``ids`` [...] of the matrix ``pack_panels`` packed -> [..., k]."""
    rows = packed[ids // PANEL, :, ids % PANEL, :]  # [..., kp / group, group]
    return rows.reshape(*ids.shape, -1)[..., :k]


def _pad_rows(t: torch.Tensor | None, m: int) -> torch.Tensor | None:
    if t is None or t.shape[0] == m:
        return t
    out = torch.zeros(m, dtype=t.dtype)
    out[:t.shape[0]] = t
    return out


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """weight [m, k] float -> (q [m, k] int8, scale [m] float32, row sums of q [m] int32)."""
    w = weight.to(torch.float32)
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scale.contiguous(), q.sum(dim=1, dtype=torch.int32).contiguous()


class PackedLinear(nn.Module):
    """``y = x W^T (+ b)`` with W stored in ``fmt``; float32 in, float32 out, any leading shape."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, ops: CpuOps | None,
                 scale: torch.Tensor | None = None, wsum: torch.Tensor | None = None) -> None:
        """``weight`` [out, in] row-major in ``fmt``'s dtype; bfloat16 and int8 are repacked into
        panels when the kernels serve them (``ops``), the int8 ``scale``/``wsum`` padded with them."""
        super().__init__()
        if fmt not in FORMATS:
            raise ValueError(f"weight format: expected one of {FORMATS}, got {fmt!r}")
        self.fmt, self.ops = fmt, ops
        self.out_features, self.in_features = weight.shape
        self.packed = ops is not None and fmt in GROUP
        rows = _pad_to(self.out_features, UNIT) if self.packed else self.out_features
        self.weight = nn.Parameter(pack_panels(weight, GROUP[fmt]) if self.packed else weight.contiguous(),
                                   requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(_pad_rows(bias.to(torch.float32), rows).contiguous(),
                                                           requires_grad=False)
        self.register_buffer("scale", _pad_rows(scale, rows))  # int8: [rows] float32
        self.register_buffer("wsum", _pad_rows(wsum, rows))  # int8: [rows] int32
        self._desc: LinearDesc | None = None

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, ops: CpuOps | None) -> PackedLinear:
        if fmt == "int8":
            q, scale, wsum = quantize_int8(weight)
            return cls(q, bias, fmt, ops, scale, wsum)
        return cls(weight.to(torch.float32 if fmt == "float32" else torch.bfloat16), bias, fmt, ops)

    def take_bias(self) -> torch.Tensor | None:
        """Remove the bias and return it ([out] float32): a row-parallel layer of a tensor-parallel
        rank adds it once, after the sum over ranks."""
        bias, self.bias, self._desc = self.bias, None, None
        return None if bias is None else bias.data[:self.out_features]

    def unpacked(self) -> torch.Tensor:
        """The weight as [out, in] in its format's dtype (int8 without its scales)."""
        if not self.packed:
            return self.weight
        return unpack_rows(self.weight, torch.arange(self.out_features), self.in_features)

    def desc(self) -> LinearDesc:
        """The C descriptor, rebuilt if the tensors moved (e.g. after ``.to()``)."""
        d = self._desc
        if d is None or d.w != self.weight.data_ptr():
            ptr = lambda t: None if t is None else t.data_ptr()  # noqa: E731
            d = LinearDesc(self.weight.data_ptr(), ptr(self.scale), ptr(self.wsum), ptr(self.bias),
                           self.weight.stride(0), self.out_features, self.in_features, _WTYPE[self.fmt], 0)
            self._desc = d
        return d

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.project(x)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in] -> x W^T (+ b) [..., out]`` float32."""
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32 or x2.stride(-1) != 1:
            x2 = x2.to(torch.float32).contiguous()
        if self.ops is None or x2.device.type != "cpu":
            return self._torch(x2).view(*lead, self.out_features)
        return self.on_kernel(x2).view(*lead, self.out_features)

    def on_kernel(self, x2: torch.Tensor) -> torch.Tensor:
        """``x2 [n, in]`` float32, contiguous -> ``[n, out]`` on the C kernel, whatever ``n``."""
        y = torch.empty(x2.shape[0], self.out_features, dtype=torch.float32)
        self.ops.linear(self.desc(), x2, y, torch.get_num_threads())
        return y

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        w, m = self.unpacked(), self.out_features
        bias = None if self.bias is None else self.bias[:m]
        if self.fmt == "float32":
            if ONEDNN_LINEAR is not None and x.device.type == "cpu":
                return ONEDNN_LINEAR(x, w, bias, "none", [], "")
            return F.linear(x, w, bias)
        if self.fmt == "bfloat16":
            y = F.linear(x.to(torch.bfloat16), w).to(torch.float32)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, w, self.scale[:m])
        return y if bias is None else y + bias

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` of W as float32 (an embedding lookup in a tied or packed table)."""
        if self.packed:
            rows = unpack_rows(self.weight, ids, self.in_features).to(torch.float32)
        else:
            rows = F.embedding(ids, self.weight).to(torch.float32)
        return rows * self.scale[ids].unsqueeze(-1) if self.fmt == "int8" else rows

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, format={self.fmt}, bias={self.bias is not None}"


class PackedEmbedding(PackedLinear):
    """A token embedding table in a weight format: ``forward(ids)`` looks rows up; a tied LM
    head uses the same table through :meth:`PackedLinear.project`."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids)


def pack_linear(layer: nn.Linear, fmt: str, ops: CpuOps | None) -> PackedLinear:
    return PackedLinear.from_float(layer.weight.data, None if layer.bias is None else layer.bias.data, fmt, ops)
