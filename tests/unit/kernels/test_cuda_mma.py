"""The emulated mma.sync m16n8k16 alone, and the tensor-core prefill kernel on the emulator.

The probe (testing/kernels/mma_probe.cu) loads fragments from the PTX ISA's layout formulas and
multiplies one 16x16 by 16x8 tile per warp: against ``a @ b + c`` it pins the emulator's gather
(a transposed register, a swapped half, warps sharing exchange slots) independently of the
attention kernel. The GPU variant runs the same probe on the tensor cores (make gpu-check).
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from testing.kernels import mma_probe

_HAVE_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None


def _operands(dtype: torch.dtype, warps: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(warps, 16, 16, generator=gen).to(dtype)
    b = torch.randn(warps, 16, 8, generator=gen).to(dtype)
    c = torch.randn(warps, 16, 8, generator=gen)
    return a, b, c, a.double() @ b.double() + c.double()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_emulated_mma_is_the_matrix_product(dtype):
    seed = random.randrange(1 << 30)
    a, b, c, ref = _operands(dtype, warps=3, seed=seed)  # 3 warps: each its own exchange slots
    d = mma_probe.emulated(a, b, c)
    # Products are exact in float32; 16 float32 additions round at most ~16 ulp of the partial sums.
    torch.testing.assert_close(d.double(), ref, rtol=1e-6, atol=1e-5, msg=f"seed {seed}")


def test_emulated_mma_places_every_element():
    """One-hot A and B: D[i, j] = [A's one at (i, k) and B's at (k, j)], so any lane, register or
    half mixed up lands a 1 in the wrong place or loses it."""
    a = torch.zeros(16 * 8, 16, 16, dtype=torch.float16)
    b = torch.zeros(16 * 8, 16, 8, dtype=torch.float16)
    for w, (i, j) in enumerate((i, j) for i in range(16) for j in range(8)):
        k = (3 * i + 5 * j) % 16
        a[w, i, k] = 1
        b[w, k, j] = 2
    d = mma_probe.emulated(a, b, torch.zeros(16 * 8, 16, 8))
    ref = a.float() @ b.float()
    assert torch.equal(d, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA GPU and CuPy (run make gpu-check)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["f16", "bf16"])
def test_gpu_mma_matches_the_emulator_layout(dtype):
    a, b, c, ref = _operands(dtype, warps=2, seed=random.randrange(1 << 30))
    torch.testing.assert_close(mma_probe.on_gpu(a, b, c).double(), ref, rtol=1e-5, atol=1e-4)


# (dtype, head_size, block_size, num_q_heads, num_kv_heads): every group size the 64-row tile takes
# (1, 2, 3, 4, 7, 8 q heads per KV head: 64, 32, 21, 16, 9, 8 tokens per tile) and every head size.
MMA_CONFIGS = [("bfloat16", 128, 16, 8, 2), ("float16", 64, 32, 4, 4), ("bfloat16", 96, 8, 14, 2),
               ("float16", 16, 16, 4, 2), ("bfloat16", 80, 16, 16, 2), ("float16", 32, 8, 6, 2)]
MMA_IDS = [f"{d}-h{h}-b{b}-q{q}kv{kv}" for d, h, b, q, kv in MMA_CONFIGS]
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {"float16": 2e-3, "bfloat16": 1e-2}  # as the SIMT prefill's tests
SCALE = 0.107


KERNELS = ("mma", "mma_pipe")  # the launcher's names of build.PREFILL_MMA_KERNELS


def _mma_keys():
    from cupy_kernels.build import PREFILL_MMA_KERNELS, KernelKey, group_size, prefill_mma_tokens

    return [KernelKey("prefill_mma", d, h, b, g, prefill_mma_tokens(g), variant=v)
            for d, h, b, q, kv in MMA_CONFIGS for g in [group_size(q // kv)] for v in PREFILL_MMA_KERNELS]


@pytest.fixture(scope="module")
def emu():
    from testing.kernels.emulate import Emulator

    return Emulator(_mma_keys())


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("cfg", MMA_CONFIGS, ids=MMA_IDS)
def test_emulated_mma_prefill_ragged_chunks_over_cached_prefixes(emu, cfg, kernel):
    """Several sequences in one launch: a fresh prompt of two K/V tiles, a chunk of 37 over a
    113-token prefix (query tiles across KV block boundaries, a partial last K/V tile, three tiles
    of context), a single row, a fresh prompt ending mid-block, a chunk right after one block.
    ``mma_pipe``: the same over two shared-memory stages (the emulator lands a cp.async only at the
    wait that covers it, so a stage read before its wait fails here)."""
    from testing.kernels.cases import make_case
    from testing.kernels.reference import ref_attention, ref_reshape_and_cache, rel_error

    dtype, head, bs, nq, nkv = cfg
    ctx, qs = [70, 150, 9, 21, bs + 5], [70, 37, 1, 21, 5]
    seed = random.randrange(1 << 30)
    case = make_case(ctx, qs, nq, nkv, head, bs, DTYPES[dtype], "cpu", seed=seed)
    ref_reshape_and_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    ref = ref_attention(case.query, case.k_cache, case.v_cache, case.block_tables, ctx, case.starts, SCALE)
    out = torch.full_like(case.query, float("nan"))
    emu.prefill(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc,
                max(qs), max(ctx), SCALE, out, kernel=kernel)
    err = rel_error(out, ref)
    assert err < TOL[dtype], f"{kernel} prefill: relative error {err:.3g} >= {TOL[dtype]} (seed {seed})"
    for i, (lo, hi) in enumerate(zip(case.starts[:-1], case.starts[1:], strict=True)):  # every sequence, not just the total
        seq_err = rel_error(out[lo:hi], ref[lo:hi])
        assert seq_err < TOL[dtype], f"sequence {i}: relative error {seq_err:.3g} (seed {seed})"


@pytest.mark.parametrize("kernel", KERNELS)
def test_emulated_mma_prefill_writes_only_its_rows(emu, kernel):
    """Rows of a query buffer past query_start_loc's last entry stay untouched (the 64-row tile's
    unused rows are never stored), and a packed query with a larger row stride (a slice of a
    fused QKV projection) is read through the stride."""
    from testing.kernels.cases import make_case
    from testing.kernels.reference import ref_attention, ref_reshape_and_cache, rel_error

    dtype, head, bs, nq, nkv = MMA_CONFIGS[0]
    ctx, qs = [40, 19], [23, 19]
    seed = random.randrange(1 << 30)
    case = make_case(ctx, qs, nq, nkv, head, bs, DTYPES[dtype], "cpu", seed=seed)
    ref_reshape_and_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    n = case.query.shape[0]
    fused = torch.randn(n + 3, 3, nq * head).to(DTYPES[dtype])
    query = fused[:, 1].view(n + 3, nq, head)
    query[:n] = case.query
    ref = ref_attention(case.query, case.k_cache, case.v_cache, case.block_tables, ctx, case.starts, SCALE)
    out = torch.full((n + 3, nq, head), float("nan"), dtype=DTYPES[dtype])
    emu.prefill(query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.query_start_loc,
                max(qs), max(ctx), SCALE, out, kernel=kernel)
    assert rel_error(out[:n], ref) < TOL[dtype], f"seed {seed}"
    assert out[n:].isnan().all()
