"""The CPU linear kernels (csrc/linear_cpu.c, linear_x86.c) against torch, on every instruction-set
path this machine has, with shapes that hit every tail (rows, inputs, tokens)."""

from __future__ import annotations

import ctypes

import pytest
import torch

from executor_svc.cpu_kernels import build_with_flags
from executor_svc.cpu_ops import ISA_NAMES, CpuOps, native_ops
from executor_svc.model.weights import PackedLinear, pack_panels, quantize_int8, unpack_rows

# (tokens, inputs, outputs): tails of the 4-token tiles, 64-output units, 16/32/64-wide vectors
SHAPES = [(1, 64, 8), (3, 160, 13), (5, 100, 70), (17, 33, 130), (4, 512, 256)]


@pytest.fixture(scope="module")
def ops():
    ops = native_ops()
    yield ops
    ops.limit_isa("avx512")  # (the library is shared by the process: leave the best path on)


def _isas(ops) -> list[str]:
    best = {ops.isa(w) for w in range(3)}
    order = list(ISA_NAMES.values())
    return order[:max(order.index(b) for b in best) + 1]


def _reference(fmt: str, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """What each format computes, in float64 from the same rounded operands."""
    if fmt == "float32":
        return (x.double() @ w.double().T + b).float()
    if fmt == "bfloat16":
        return (x.bfloat16().double() @ w.bfloat16().double().T + b).float()
    q, scale, _ = quantize_int8(w)
    sx = x.abs().amax(1) / 127
    qx = torch.round(x / sx[:, None])
    return ((qx.double() @ q.double().T) * scale.double() * sx.double()[:, None] + b).float()


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("shape", SHAPES)
def test_every_path_matches_the_reference(ops, fmt, shape):
    n, k, m = shape
    g = torch.Generator().manual_seed(n * 1000 + k + m)
    x, w, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(m, generator=g)
    ref = _reference(fmt, x, w, b)
    layer = PackedLinear.from_float(w, b, fmt, ops)
    for isa in _isas(ops):
        ops.limit_isa(isa)
        y = layer(x)
        assert y.shape == (n, m)
        torch.testing.assert_close(y, ref, rtol=2e-5, atol=2e-5 * float(ref.abs().max()), msg=f"{fmt} {isa}")
    ops.limit_isa("avx512")


@pytest.mark.parametrize("fmt", ["float32", "bfloat16", "int8"])
def test_a_row_gives_the_same_bits_whatever_the_rows_beside_it(ops, fmt, monkeypatch):
    """A prefill's many rows run on the same kernel as a decode step's few (oneDNN, MKL never),
    and each row's result is bit-identical to that row computed alone, on any thread count."""
    n, k, m = 77, 96, 70  # past the 4-token tiles and any small-batch threshold
    g = torch.Generator().manual_seed(5)
    x, w, b = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g), torch.randn(m, generator=g)
    layer = PackedLinear.from_float(w, b, fmt, ops)
    monkeypatch.setattr(layer, "_torch", lambda *a: pytest.fail("a torch GEMM was used"))
    whole = layer(x)
    ref = _reference(fmt, x, w, b)
    torch.testing.assert_close(whole, ref, rtol=2e-5, atol=2e-5 * float(ref.abs().max()))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for rows in (slice(0, 1), slice(5, 6), slice(3, 40), slice(60, 77)):
            assert torch.equal(layer(x[rows].contiguous()), whole[rows]), f"{fmt} rows {rows}"
    finally:
        torch.set_num_threads(threads)


def test_int8_sums_are_the_same_on_every_path(ops):
    """Integer dot products are exact, so AVX-512 VNNI, AVX2 and scalar agree to the last bit of the sum."""
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(6, 200, generator=g), torch.randn(90, 200, generator=g)
    layer = PackedLinear.from_float(w, None, "int8", ops)
    outs = []
    for isa in _isas(ops):
        ops.limit_isa(isa)
        outs.append(layer(x))
    ops.limit_isa("avx512")
    for y in outs[1:]:
        torch.testing.assert_close(y, outs[0], rtol=1e-6, atol=0)


def test_accumulate_adds_to_the_output(ops):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(2, 96, generator=g), torch.randn(40, 96, generator=g)
    for fmt in ("float32", "bfloat16", "int8"):
        layer = PackedLinear.from_float(w, None, fmt, ops)
        y = torch.ones(2, 40)
        ops.linear(layer.desc(), x, y, threads=2, accumulate=True)
        torch.testing.assert_close(y, layer(x) + 1)


def test_panels_round_trip_and_embedding_rows(ops):
    w = torch.randn(70, 10)
    packed = pack_panels(w, 4)
    assert packed.shape == (128 // 16, 12 // 4, 16, 4)  # rows padded to 64 (2 units), inputs to 4
    ids = torch.tensor([[0, 69], [17, 64]])
    assert torch.equal(unpack_rows(packed, ids, 10), w[ids])
    for fmt in ("bfloat16", "int8"):
        layer = PackedLinear.from_float(w, None, fmt, ops)
        plain = PackedLinear.from_float(w, None, fmt, None)  # no kernels: row-major, torch
        assert layer.packed and not plain.packed
        assert torch.equal(layer.rows(ids), plain.rows(ids))
        assert torch.equal(layer.unpacked(), plain.weight)


def test_int8_quantization_is_symmetric_per_channel():
    w = torch.randn(32, 50) * torch.linspace(0.01, 10, 32)[:, None]
    w[5] = 0
    q, scale, wsum = quantize_int8(w)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert torch.equal(q[5], torch.zeros(50, dtype=torch.int8))
    assert torch.equal(wsum, q.sum(1, dtype=torch.int32))
    err = (q.float() * scale[:, None] - w).abs()
    assert bool((err <= scale[:, None] / 2 + 1e-6).all())  # round to nearest: half a step at most


def test_torch_fallback_computes_the_same_format(ops):
    """Where the kernels do not load, the formats run on torch: same weights, same results within rounding."""
    g = torch.Generator().manual_seed(11)
    x, w, b = torch.randn(3, 64, generator=g), torch.randn(20, 64, generator=g), torch.randn(20, generator=g)
    for fmt, tol in (("float32", 1e-5), ("bfloat16", 2e-2), ("int8", 3e-2)):
        fast, slow = PackedLinear.from_float(w, b, fmt, ops), PackedLinear.from_float(w, b, fmt, None)
        scale = float(fast(x).abs().max())
        torch.testing.assert_close(fast(x), slow(x), rtol=tol, atol=tol * scale, msg=fmt)


def test_bad_descriptors_are_refused_not_run(ops):
    layer = PackedLinear.from_float(torch.randn(8, 16), None, "float32", ops)
    desc = layer.desc()
    desc.k = 0
    with pytest.raises(ValueError, match="shape or type"):
        ops.linear(desc, torch.randn(1, 16), torch.empty(1, 8), threads=1)


def test_a_build_with_other_flags_computes_the_same(ops, tmp_path):
    """benchmarks' --variant builds (cpu_kernels.build_with_flags): the prefetch hint is a build-time
    choice of speed only, so the other hint's library gives the same bits on every path."""
    build = build_with_flags(["-DPS_PF_HINT=_MM_HINT_T0"], tmp_path / "t0.so")
    assert build.compiled and "-DPS_PF_HINT=_MM_HINT_T0" in build.flags
    other = CpuOps(ctypes.CDLL(str(build.path)), str(build.path))
    g = torch.Generator().manual_seed(7)
    x, w = torch.randn(5, 1408, generator=g), torch.randn(300, 1408, generator=g)
    for fmt in ("float32", "bfloat16", "int8"):
        ours, theirs = PackedLinear.from_float(w, None, fmt, ops), PackedLinear.from_float(w, None, fmt, other)
        for isa in _isas(ops):
            ops.limit_isa(isa)
            other.limit_isa(isa)
            assert torch.equal(ours(x), theirs(x)), f"{fmt} {isa}"
    ops.limit_isa("avx512")
    with pytest.raises(RuntimeError, match="PS_NO_SUCH_HINT"):
        build_with_flags(["-DPS_PF_HINT=PS_NO_SUCH_HINT"], tmp_path / "bad.so")
