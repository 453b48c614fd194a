"""Linear layers kept in llama.cpp's block formats (Q8_0, Q4_0, Q4_1, Q4_K) on the CPU.

A GGUF file's Q8_0/Q4_0/Q4_1/Q4_K tensors are not dequantized: their blocks (32 inputs of a row
with a float16 scale, and for Q4_1 an offset; Q4_K: 256 inputs with float16 scale and offset
over 8 groups of 32 with 6-bit ones) are repacked into the layout of ``csrc/linear_blocks.h``
(16 rows side by side, so one vector load feeds 16 outputs; Q4_K's packed 6-bit fields and
nibbles spread to one byte per field and Q4_0's nibble pairing), and the kernels of
``csrc/linear_blocks*.c`` compute on them: each token's activations are quantised to 8-bit
blocks of 32 and the dot products are integer, as llama.cpp's own CPU kernels do. A step then
reads 8.5 (Q8_0), 4.5 (Q4_0), 5 (Q4_1) or 4.6 (Q4_K) bits per weight. ``--quantization int8`` rounds
float weights to Q8_0 blocks (``gguf.quants.quantize``, llama.cpp's rounding) and runs the
same kernels.

Where the C library is unavailable a layer keeps GGUF's own row-major bytes and computes on
torch with weights dequantized by ``gguf.quants`` at every call: correct, slow, the same memory.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch
import torch.nn.functional as F
from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize
from torch import nn

from executor_svc.cpu_ops import W_Q4_0, W_Q4_1, W_Q4_K, W_Q8_0, CpuOps, LinearDesc, check_status
from executor_svc.model.weights import UNIT, PackedLinear, _pad_rows, _pad_to

BLOCK_FORMATS = {"q8_0": Q.Q8_0, "q4_0": Q.Q4_0, "q4_1": Q.Q4_1, "q4_k": Q.Q4_K}
_WTYPE = {"q8_0": W_Q8_0, "q4_0": W_Q4_0, "q4_1": W_Q4_1, "q4_k": W_Q4_K}
BLOCK, PANEL = 32, 16
QK_SUB = 8  # Q4_K: blocks of 32 in a super-block of 256


def block_format(qtype: Q) -> str | None:
    """The block format that computes ``qtype`` as stored, or None (dequantized at load)."""
    return next((name for name, t in BLOCK_FORMATS.items() if t == qtype), None)


def q4_k_fields(blocks: np.ndarray) -> tuple[np.ndarray, ...]:
    """Q4_K super-blocks [..., 144] uint8 -> (d, dmin [..., 2] float16 bytes; sc, mn [..., 8] the
    6-bit scale and offset of each block of 32; nibbles [..., 8, 32] its quants), as ggml's
    ``get_scale_min_k4`` and ``dequantize_row_q4_K`` read them."""
    d, dmin, s, qs = blocks[..., 0:2], blocks[..., 2:4], blocks[..., 4:16], blocks[..., 16:144]
    lo, hi = s[..., 0:4], s[..., 4:8]
    sc = np.concatenate([lo & 63, (s[..., 8:12] & 15) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([hi & 63, (s[..., 8:12] >> 4) | ((hi >> 6) << 4)], axis=-1)
    pairs = qs.reshape(*qs.shape[:-1], 4, 32)  # block 2i: low nibbles of 32 bytes, 2i + 1: high
    nibbles = np.stack([pairs & 15, pairs >> 4], axis=-2).reshape(*qs.shape[:-1], QK_SUB, BLOCK)
    return d, dmin, sc, mn, nibbles


def pack_blocks(raw: np.ndarray, qtype: Q) -> torch.Tensor:
    """GGUF rows [m, nb * block bytes] uint8 -> the kernels' layout [mp / 16, panel bytes] uint8
    (``csrc/linear_blocks.h``), rows padded to a multiple of 64 with zero blocks (scale 0: they
    add nothing)."""
    per_block = GGML_QUANT_SIZES[qtype][1]
    m, nb = raw.shape[0], raw.shape[1] // per_block
    mp = _pad_to(m, UNIT)
    blocks = np.zeros((mp, nb, per_block), dtype=np.uint8)
    blocks[:m] = np.asarray(raw, dtype=np.uint8).reshape(m, nb, per_block)
    panels = mp // PANEL

    def by_panel(field: np.ndarray, groups: int) -> np.ndarray:
        """[mp, nb, groups * 4] -> [panels, nb, groups * 64]: group v of the 16 rows side by side."""
        f = field.reshape(panels, PANEL, nb, groups, 4).transpose(0, 2, 3, 1, 4)
        return f.reshape(panels, nb, groups * PANEL * 4)

    def per_row(field: np.ndarray) -> np.ndarray:  # [mp, nb, w] -> [panels, nb, 16 * w]: row after row
        w = field.shape[-1]
        return field.reshape(panels, PANEL, nb, w).transpose(0, 2, 1, 3).reshape(panels, nb, PANEL * w)

    if qtype == Q.Q8_0:  # d, 32 int8
        parts = [by_panel(blocks[..., 2:34], 8), per_row(blocks[..., 0:2])]
    elif qtype == Q.Q4_0:  # d, 16 bytes of nibble pairs (j, j + 16)
        parts = [by_panel(blocks[..., 2:18], 4), per_row(blocks[..., 0:2])]
    elif qtype == Q.Q4_1:  # d, m, 16 bytes
        parts = [by_panel(blocks[..., 4:20], 4), per_row(blocks[..., 0:2]), per_row(blocks[..., 2:4])]
    elif qtype == Q.Q4_K:  # super-blocks: 8 blocks' quants paired as Q4_0's, then sc, mn, d, dmin
        d, dmin, sc, mn, q = q4_k_fields(blocks)
        paired = (q[..., :16] | (q[..., 16:] << 4)).astype(np.uint8)  # [mp, nb, 8, 16]
        quants = paired.reshape(panels, PANEL, nb, QK_SUB, 4, 4).transpose(0, 2, 3, 4, 1, 5)
        parts = [quants.reshape(panels, nb, QK_SUB * 256),
                 sc.reshape(panels, PANEL, nb, QK_SUB).transpose(0, 2, 3, 1).reshape(panels, nb, QK_SUB * PANEL),
                 mn.reshape(panels, PANEL, nb, QK_SUB).transpose(0, 2, 3, 1).reshape(panels, nb, QK_SUB * PANEL),
                 per_row(d), per_row(dmin)]
    else:
        raise ValueError(f"block formats: {', '.join(BLOCK_FORMATS)}, got {qtype.name}")
    return torch.from_numpy(np.ascontiguousarray(np.concatenate(parts, axis=-1)))


def quantize_blocks(weight: torch.Tensor, qtype: Q = Q.Q8_0) -> np.ndarray:
    """Float weights [m, k] -> GGUF rows of ``qtype`` blocks (llama.cpp's rounding), k padded
    with zeros to whole blocks."""
    w = weight.detach().to(torch.float32).numpy()
    k = w.shape[1]
    if k % BLOCK:
        w = np.pad(w, ((0, 0), (0, BLOCK - k % BLOCK)))
    return quantize(np.ascontiguousarray(w), qtype)


class BlockLinear(PackedLinear):
    """``y = x W^T (+ b)`` with W in a block format; float32 in, float32 out, any leading shape."""

    def __init__(self, raw: np.ndarray, fmt: str, k: int, bias: torch.Tensor | None, ops: CpuOps | None) -> None:
        """``raw``: GGUF rows [m, nb * block bytes] of ``fmt``'s type (nb = ceil(k / 32))."""
        nn.Module.__init__(self)
        if fmt not in BLOCK_FORMATS:
            raise ValueError(f"block format: expected one of {tuple(BLOCK_FORMATS)}, got {fmt!r}")
        qtype = BLOCK_FORMATS[fmt]
        size, per_block = GGML_QUANT_SIZES[qtype]
        if size > BLOCK and k % size:
            raise ValueError(f"{fmt} rows hold whole blocks of {size} inputs; got {k} inputs")
        if raw.ndim != 2 or raw.shape[1] != -(-k // size) * per_block:
            raise ValueError(f"{fmt} rows of {k} inputs take {-(-k // size) * per_block} bytes, got {raw.shape}")
        self.fmt, self.ops, self.qtype = fmt, ops, qtype
        self.out_features, self.in_features = raw.shape[0], k
        self.packed = ops is not None
        w = pack_blocks(raw, qtype) if self.packed else torch.from_numpy(np.array(raw, dtype=np.uint8))
        self.weight = nn.Parameter(w, requires_grad=False)
        rows = _pad_to(self.out_features, UNIT) if self.packed else self.out_features
        self.bias = None if bias is None else nn.Parameter(_pad_rows(bias.to(torch.float32), rows).contiguous(),
                                                           requires_grad=False)
        self.scale = self.wsum = None
        self._desc: LinearDesc | None = None

    @classmethod
    def from_float(cls, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str, ops: CpuOps | None) -> BlockLinear:
        return cls(quantize_blocks(weight, BLOCK_FORMATS[fmt]), fmt, weight.shape[1], bias, ops)

    def desc(self) -> LinearDesc:
        d = self._desc
        if d is None or d.w != self.weight.data_ptr():
            bias = None if self.bias is None else self.bias.data_ptr()
            d = LinearDesc(self.weight.data_ptr(), None, None, bias, 0, self.out_features, self.in_features,
                           _WTYPE[self.fmt], 0)
            self._desc = d
        return d

    def unpacked(self) -> torch.Tensor:
        """The weights dequantized to float32 [out, in] (GGUF's values)."""
        return self.rows(torch.arange(self.out_features))

    def _torch(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias[:self.out_features]
        return F.linear(x, self.unpacked(), bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ``ids`` [...] of W as float32 [..., in] (an embedding lookup)."""
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        if not self.packed:
            raw = self.weight.numpy()[flat.numpy()]
            w = dequantize(raw, self.qtype).reshape(len(flat), -1)[:, :self.in_features]
            return torch.from_numpy(np.ascontiguousarray(w, dtype=np.float32)).view(*ids.shape, self.in_features)
        out = torch.empty(flat.shape[0], self.in_features, dtype=torch.float32)
        check_status("block rows", self.ops.lib.ps_blocks_rows(ctypes.byref(self.desc()), flat.data_ptr(),
                                                               flat.shape[0], out.data_ptr(), self.in_features))
        return out.view(*ids.shape, self.in_features)


class BlockEmbedding(BlockLinear):
    """A token embedding table in a block format (a tied LM head uses it through ``project``)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.rows(ids)
