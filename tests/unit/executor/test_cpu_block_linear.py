"""The block-format linear kernels (csrc/linear_blocks*.c) against a numpy reference on the same
GGUF blocks (``gguf.quants``), on every instruction-set path this machine has (scalar and AVX2
forced through ``limit_isa``), with shapes that hit every tail (rows, blocks, tokens). Q4_K
blocks are random (``gguf.quants`` cannot write them; any valid block is a fair test)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from executor_svc.cpu_ops import ISA_NAMES, W_Q4_1, native_ops
from executor_svc.model.block_weights import BLOCK_FORMATS, BlockEmbedding, BlockLinear, pack_blocks
from testing.gguf_files import k_quant_rows

FORMATS = list(BLOCK_FORMATS)
# (tokens, inputs, outputs): 1-4 token tiles and their tails, 16-row panels and 64-row units
# with tails, one block to many, inputs that are not whole blocks (int8 on any checkpoint)
SHAPES = [(1, 64, 8), (3, 160, 13), (5, 96, 70), (17, 32, 130), (4, 512, 256), (2, 100, 40)]
# Q4_K rows are whole super-blocks of 256 inputs
K_SHAPES = [(1, 256, 8), (3, 512, 13), (5, 256, 70), (17, 768, 130), (4, 512, 256)]
CASES = [(fmt, shape) for fmt in FORMATS for shape in (K_SHAPES if fmt == "q4_k" else SHAPES)]


@pytest.fixture(scope="module")
def ops():
    ops = native_ops()
    yield ops
    ops.limit_isa("avx512")  # (the library is shared by the process: leave the best path on)


def _isas(ops) -> list[str]:
    order = list(ISA_NAMES.values())
    return order[:order.index(ops.isa(W_Q4_1)) + 1]


def _blocks(fmt: str, w: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    if fmt == "q4_k":
        return k_quant_rows(Q.Q4_K, *w.shape, rng)
    k = w.shape[1]
    return quantize(np.pad(w, ((0, 0), (0, -k % 32))), BLOCK_FORMATS[fmt])


def _reference(fmt: str, x: np.ndarray, raw: np.ndarray, k: int, bias: np.ndarray | None) -> np.ndarray:
    """float64 of what the kernels compute: GGUF's dequantized weights against the activations
    as quantized per block of 32 in two 8-bit parts (csrc/linear_blocks.h), float32 roundings
    of the quantization reproduced step by step."""
    w = dequantize(raw, BLOCK_FORMATS[fmt]).reshape(raw.shape[0], -1).astype(np.float64)
    n, nb = x.shape[0], w.shape[1] // 32
    xb = np.zeros((n, nb * 32), np.float32)
    xb[:, :k] = x
    xb = xb.reshape(n, nb, 32)
    d = (np.abs(xb).max(-1) / np.float32(127)).astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(d > 0, xb / d, np.float32(0)).astype(np.float32)
    q1 = np.round(v)
    q2 = np.round((v - q1) * np.float32(254))
    assert np.abs(q2).max() <= 127
    xq = ((254 * q1 + q2) * (d / np.float32(254)).astype(np.float32)).reshape(n, -1).astype(np.float64)
    y = xq @ w.T
    return y if bias is None else y + bias


def _case(fmt: str, shape, seed: int, bias: bool = True):
    n, k, m = shape
    rng = np.random.default_rng(seed)
    x = rng.normal(0, 1, (n, k)).astype(np.float32)
    x[0, :min(k, 7)] *= 30  # an outlier block, as real activations have
    w = rng.normal(0, 0.05, (m, k)).astype(np.float32)
    b = rng.normal(0, 1, m).astype(np.float32) if bias else None
    return x, _blocks(fmt, w, rng), b


@pytest.mark.parametrize("fmt,shape", CASES)
def test_every_path_matches_the_reference_and_gives_the_same_bits(ops, fmt, shape):
    x, raw, b = _case(fmt, shape, seed=sum(shape))
    n, k, m = shape
    ref = _reference(fmt, x, raw, k, b)
    layer = BlockLinear(raw, fmt, k, None if b is None else torch.from_numpy(b), ops)
    outs = {}
    for isa in _isas(ops):
        ops.limit_isa(isa)
        outs[isa] = layer(torch.from_numpy(x))
        assert outs[isa].shape == (n, m)
        np.testing.assert_allclose(outs[isa].numpy(), ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max(),
                                   err_msg=f"{fmt} {isa}")
    ops.limit_isa("avx512")
    first = outs[_isas(ops)[0]]
    for isa, y in outs.items():  # exact integer sums and one float epilogue on every path
        assert torch.equal(y, first), f"{fmt}: {isa} differs from scalar by {float((y - first).abs().max())}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_two_part_activations_compute_as_float32_would(ops, fmt):
    """What the second 8-bit part buys: the result is that of float32 activations on the same
    weights to ~5e-5 of the largest output, where one part (llama.cpp's Q8_0 activations) errs
    by ~8e-3."""
    k = 768 if fmt == "q4_k" else 576
    x, raw, _ = _case(fmt, (4, k, 96), seed=3, bias=False)
    w = dequantize(raw, BLOCK_FORMATS[fmt]).reshape(raw.shape[0], -1)[:, :k].astype(np.float64)
    exact = x.astype(np.float64) @ w.T
    y = BlockLinear(raw, fmt, k, None, ops)(torch.from_numpy(x)).numpy()
    assert np.abs(y - exact).max() < 2e-4 * np.abs(exact).max()


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_row_gives_the_same_bits_whatever_the_rows_beside_it(ops, fmt):
    """Each token's activations are quantised on their own and every (token, row) sum runs over
    the blocks in one order: a row alone, in any group, on one thread or two, gives one result."""
    k = 256 if fmt == "q4_k" else 96
    x, raw, b = _case(fmt, (37, k, 70), seed=5)
    layer = BlockLinear(raw, fmt, k, torch.from_numpy(b), ops)
    monkey = layer._torch
    layer._torch = lambda *a: pytest.fail("the torch path was used")
    xt = torch.from_numpy(x)
    whole = layer(xt)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rows in (slice(0, 1), slice(5, 6), slice(3, 30), slice(30, 37)):
            assert torch.equal(layer(xt[rows].contiguous()), whole[rows]), f"{fmt} rows {rows}"
    finally:
        torch.set_num_threads(threads)
        layer._torch = monkey


def test_accumulate_adds_to_the_output(ops):
    x, raw, _ = _case("q4_1", (2, 96, 40), seed=7, bias=False)
    layer = BlockLinear(raw, "q4_1", 96, None, ops)
    xt = torch.from_numpy(x)
    y = torch.ones(2, 40)
    ops.linear(layer.desc(), xt, y, threads=2, accumulate=True)
    torch.testing.assert_close(y, layer(xt) + 1)


@pytest.mark.parametrize("fmt", FORMATS)
def test_packing_keeps_every_byte_and_rows_are_ggufs_values(ops, fmt):
    """The packed layout is a permutation of the file's bytes (plus zero padding; Q4_K's packed
    fields spread to a byte each), and a row looked up (an embedding) is exactly gguf.quants'
    dequantized row."""
    k = 512 if fmt == "q4_k" else 128
    _, raw, _ = _case(fmt, (1, k, 70), seed=11)
    packed = pack_blocks(raw, BLOCK_FORMATS[fmt])
    assert packed.shape[0] == 128 // 16  # rows padded to 128
    if fmt == "q4_k":  # 2,368 bytes a panel's super-block for GGUF's 16 x 144
        assert packed.numel() == 128 // 16 * k // 256 * 2368
    else:
        assert packed.numel() == 128 * raw.shape[1]
        flat = np.sort(packed.numpy().ravel())
        want = np.sort(np.concatenate([raw.ravel(), np.zeros(58 * raw.shape[1], np.uint8)]))
        assert np.array_equal(flat, want)
    ids = torch.tensor([[0, 69], [17, 64]])
    table = dequantize(raw, BLOCK_FORMATS[fmt]).reshape(70, -1)
    for layer in (BlockEmbedding(raw, fmt, k, None, ops), BlockEmbedding(raw, fmt, k, None, None)):
        assert torch.equal(layer(ids), torch.from_numpy(table[ids.numpy()])), "packed" if layer.ops else "plain"
    with pytest.raises(ValueError, match="shape or type"):
        BlockEmbedding(raw, fmt, k, None, ops)(torch.tensor([70]))


def test_the_torch_fallback_computes_the_same_weights(ops):
    """Where the kernels do not load, a layer keeps GGUF's own rows and runs on torch with float32
    activations: the same weights, so the same results to the activations' rounding."""
    x, raw, b = _case("q4_0", (3, 64, 20), seed=13)
    fast = BlockLinear(raw, "q4_0", 64, torch.from_numpy(b), ops)
    slow = BlockLinear(raw, "q4_0", 64, torch.from_numpy(b), None)
    assert slow.weight.shape == raw.shape and not slow.packed
    xt = torch.from_numpy(x)
    torch.testing.assert_close(fast(xt), slow(xt), rtol=1e-4, atol=1e-4 * float(slow(xt).abs().max()))


def test_non_finite_activations_show_in_the_outputs(ops):
    x, raw, _ = _case("q8_0", (2, 64, 16), seed=17, bias=False)
    x[1, 40] = np.nan
    y = BlockLinear(raw, "q8_0", 64, None, ops)(torch.from_numpy(x))
    assert torch.isfinite(y[0]).all() and torch.isnan(y[1]).all()


def test_every_path_quantises_special_blocks_alike(ops):
    """The activation quantisation (scalar, AVX2, AVX-512) on the blocks where its branches are:
    all zeros, an infinity, a NaN, a finite value past its 3e38 limit, subnormals, -0.0 and a
    ragged last block; the non-finite blocks make their row NaN on every path."""
    k = 32 * 7 + 9
    x = np.random.default_rng(3).normal(0, 1, (7, k)).astype(np.float32)
    x[0, 32:64] = 0.0
    x[0, 64:96] = -0.0
    x[1, 40] = np.inf
    x[2, 100] = np.nan
    x[3, 5] = np.float32(3.2e38)
    x[4, 64:96] = np.float32(1e-40)  # subnormal: a tiny but nonzero scale
    x[5, -9:] = np.float32(1e4)      # the ragged block's outlier
    x[6] *= np.float32(1e-30)
    raw = _blocks("q4_1", np.random.default_rng(4).normal(0, 0.05, (40, k)).astype(np.float32),
                  np.random.default_rng(5))
    layer = BlockLinear(raw, "q4_1", k, None, ops)
    outs = []
    for isa in _isas(ops):
        ops.limit_isa(isa)
        outs.append(layer(torch.from_numpy(x)).view(torch.int32))
    ops.limit_isa("avx512")
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    y = outs[0].view(torch.float32)
    assert torch.isnan(y[1:4]).all() and torch.isfinite(y[[0, 4, 5, 6]]).all()


def test_bad_blocks_are_refused_naming_the_sizes():
    raw = quantize(np.zeros((4, 64), np.float32), Q.Q4_1)
    with pytest.raises(ValueError, match="q4_1 rows of 96 inputs take 60 bytes"):
        BlockLinear(raw, "q4_1", 96, None, None)
    with pytest.raises(ValueError, match="block format"):
        BlockLinear(raw, "q5_0", 64, None, None)
    kq = k_quant_rows(Q.Q4_K, 4, 256, np.random.default_rng(0))
    with pytest.raises(ValueError, match="q4_k rows hold whole blocks of 256 inputs; got 200"):
        BlockLinear(kq, "q4_k", 200, None, None)
