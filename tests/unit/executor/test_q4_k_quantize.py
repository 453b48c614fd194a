"""testing/q4_k_quantize.py: real Q4_K roundings that gguf's own reader (and so transformers and
llama.cpp) reads back, the layout checked element by element against a direct formula."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from testing.q4_k_quantize import BLOCK_BYTES, quantize_q4_k


def _read(blocks: np.ndarray, rows: int, cols: int) -> np.ndarray:
    return np.asarray(dequantize(blocks, Q.Q4_K), dtype=np.float32).reshape(rows, cols)


@pytest.mark.parametrize("shift", [0.0, 0.3])  # centred weights, and all-positive sub-blocks (offset 0)
def test_rows_round_trip_within_the_format_error(shift):
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((16, 768)) * 0.05 + shift).astype(np.float32)
    blocks = quantize_q4_k(w)
    assert blocks.shape == (16, 3 * BLOCK_BYTES) and blocks.dtype == np.uint8
    back = _read(blocks, 16, 768)
    sub = w.reshape(-1, 32)
    span = sub.max(axis=1) - np.minimum(sub.min(axis=1), 0)  # a sub-block's fitted range
    err = np.abs(back - w).reshape(-1, 32).max(axis=1)
    # half a quant step, plus what rounding its scale and offset to 6 bits of the super-block's moves
    assert (err <= span / 15 * 0.5 + span.reshape(-1, 8).max(axis=1).repeat(8) / 63 * 8).all()
    rel = np.sqrt(((back - w) ** 2).mean() / (w ** 2).mean())
    assert rel < (0.09 if shift == 0 else 0.05), rel


def test_values_on_the_grid_come_back_exactly():
    """Sub-blocks already of the form d * sc * q - dmin * m, the super-block's largest scale and offset
    at 63 steps (so the fit finds the same d and dmin), are read back unchanged."""
    q = np.arange(256, dtype=np.float32) % 16  # every quant 0..15 in each sub-block
    sc = np.repeat(np.array([63, 1, 7, 30, 63, 12, 45, 2], dtype=np.float32), 32)
    m = np.repeat(np.array([0, 63, 5, 0, 17, 63, 0, 40], dtype=np.float32), 32)
    d, dmin = 2.0 ** -10, 2.0 ** -9
    w = (d * sc * q - dmin * m).reshape(1, 256).astype(np.float32)
    assert np.array_equal(_read(quantize_q4_k(w), 1, 256), w)


def test_rows_that_are_not_whole_super_blocks_are_refused():
    with pytest.raises(ValueError, match="256"):
        quantize_q4_k(np.zeros((2, 576), dtype=np.float32))
