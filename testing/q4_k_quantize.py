"""Float32 rows rounded to Q4_K super-blocks (what ``gguf.quants`` reads but cannot write).

A super-block holds 256 weights as 8 sub-blocks of 32: ``w = d * sc[j] * q - dmin * m[j]``, q in
0..15, sc/m 6-bit per sub-block, d/dmin float16 per super-block; 144 bytes (d, dmin, 12 bytes of
packed scales, 128 of nibbles), laid out as ggml's ``block_q4_K``. Each sub-block is fitted by its
own range (scale (max - min) / 15, offset -min clipped at 0), then the scales and offsets are
rounded to 6 bits of the super-block's largest; the quants are rounded against those rounded
scales. llama.cpp's quantizer searches scales further (``make_qkx2_quants``): this one is what a
measurement needs, a real Q4_K rounding of real weights that ``gguf.quants.dequantize`` reads back
(the agreement benchmark: ``testing/gguf_agreement.py``).
"""

from __future__ import annotations

import numpy as np

QK_K, SUB = 256, 32
BLOCK_BYTES = 144


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[rows, cols] float32 (cols a multiple of 256) -> [rows, cols / 256 * 144] uint8."""
    rows, cols = w.shape
    if cols % QK_K:
        raise ValueError(f"Q4_K: a row must be whole 256-weight super-blocks, got {cols} columns")
    x = np.asarray(w, dtype=np.float32).reshape(-1, 8, SUB)  # [super-blocks, sub-blocks, 32]
    lo = np.minimum(x.min(axis=-1), 0.0)  # offsets are subtracted: a sub-block's min, at most 0
    scale = (x.max(axis=-1) - lo) / 15.0
    offset = -lo
    d = (scale.max(axis=-1) / 63.0).astype(np.float16)
    dmin = (offset.max(axis=-1) / 63.0).astype(np.float16)
    d32, dmin32 = d.astype(np.float32)[:, None], dmin.astype(np.float32)[:, None]
    sc = np.clip(np.rint(np.divide(scale, d32, out=np.zeros_like(scale), where=d32 > 0)), 0, 63).astype(np.uint8)
    m = np.clip(np.rint(np.divide(offset, dmin32, out=np.zeros_like(offset), where=dmin32 > 0)), 0, 63).astype(np.uint8)
    step = (d32 * sc)[..., None]
    q = np.rint(np.divide(x + (dmin32 * m)[..., None], step, out=np.zeros_like(x), where=step > 0))
    q = np.clip(q, 0, 15).astype(np.uint8)
    n = x.shape[0]
    out = np.zeros((n, BLOCK_BYTES), dtype=np.uint8)
    out[:, 0:2] = d.view(np.uint8).reshape(n, 2)
    out[:, 2:4] = dmin.view(np.uint8).reshape(n, 2)
    # scales: bytes 0-3 sc[0..3] | high bits of sc[4..7]; 4-7 m[0..3] | high bits of m[4..7];
    # 8-11 low nibbles sc[4..7] | m[4..7] << 4 (gguf.quants.Q4_K.get_scale_min reads them back)
    out[:, 4:8] = (sc[:, :4] & 0x3F) | ((sc[:, 4:] >> 4) << 6)
    out[:, 8:12] = (m[:, :4] & 0x3F) | ((m[:, 4:] >> 4) << 6)
    out[:, 12:16] = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)
    # nibbles: 4 groups of 32 bytes, group g holding sub-block 2g (low) and 2g + 1 (high)
    pairs = q.reshape(n, 4, 2, SUB)
    out[:, 16:] = (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).reshape(n, 128)
    return out.reshape(rows, -1)
