"""The CUDA kernel sources executed on the CPU by the SIMT emulator (testing/kernels/emu), against
the float64 references. Not a GPU test: it runs in CI and checks the kernels' indexing, masking,
online softmax, split/reduce and GQA grouping from the exact source NVRTC compiles. Outputs and
unwritten cache slots are poisoned with NaN, inputs are fresh random numbers."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from cupy_kernels.build import (
    DECODE_KERNELS,
    KernelKey,
    group_size,
    mma_prefill_supported,
    prefill_mma_tokens,
    prefill_tokens,
)
from cupy_kernels.launchers import DECODE_VARIANTS
from testing.kernels.cases import make_case
from testing.kernels.emulate import emulate_launchers
from testing.kernels.reference import ref_attention, ref_copy_blocks, ref_reshape_and_cache, rel_error

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
# (dtype, head_size, block_size, num_q_heads, num_kv_heads): odd heads and groups, MHA, MQA, Llama
CONFIGS = [("float32", 80, 8, 12, 4), ("float16", 256, 32, 4, 4), ("bfloat16", 128, 16, 8, 2),
           ("float32", 64, 16, 16, 1), ("bfloat16", 96, 8, 14, 2), ("float32", 16, 16, 4, 2)]  # last: the tiny model
IDS = [f"{d}-h{h}-b{b}-q{q}kv{kv}" for d, h, b, q, kv in CONFIGS]
SCALE = 0.107
# Decode variants (launchers.DECODE_VARIANTS) beside "base", each on the Llama-like config (index 2)
# and two others, so that every config meets two kernel variants (the emulator runs a CUDA thread as
# a CPU thread: the full grid per variant would cost minutes); the split-rule variants on one config.
VARIANT_CONFIGS = {"pipe": (2, 0, 4), "pipe_half": (2, 0, 4), "nt2": (2, 1, 3), "w8": (2, 3, 5), "pipe_w8": (2, 1, 5),
                   "split8": (2,), "pipe_split8": (0,)}
VARIANT_CASES = [(v, CONFIGS[i]) for v, idx in VARIANT_CONFIGS.items() for i in idx]


@pytest.fixture(scope="module")
def emu():
    from testing.kernels.emulate import Emulator

    keys = []
    for d, h, b, q, kv in CONFIGS:
        g = group_size(q // kv)
        keys += [KernelKey("decode", d, h, b, g), KernelKey("decode_reduce", d, h),
                 KernelKey("prefill", d, h, b, g, prefill_tokens(g))]
        keys += [KernelKey("decode", d, h, b, g, variant=v) for v in DECODE_KERNELS]
        if mma_prefill_supported(d, h):
            keys.append(KernelKey("prefill_mma", d, h, b, g, prefill_mma_tokens(g)))
    return Emulator(keys)


def _check(out, ref, dtype, what):
    err = rel_error(out, ref)
    assert err < TOL[dtype], f"{what}: relative error {err:.3g} >= {TOL[dtype]}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_emulated_decode_single_and_split(emu, cfg):
    dtype, head, bs, nq, nkv = cfg
    ctx = [1, bs - 1, bs + 1, 2 * bs + 5, 70]
    seed = random.randrange(1 << 30)
    case = make_case(ctx, [1] * len(ctx), nq, nkv, head, bs, DTYPES[dtype], "cpu", seed=seed)
    emu.reshape_and_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    ref = ref_attention(case.query, case.k_cache, case.v_cache, case.block_tables, ctx, case.starts, SCALE)
    for parts in (1, 3):
        out = torch.full_like(case.query, float("nan"))
        emu.decode(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, max(ctx), SCALE,
                   out, num_partitions=parts)
        _check(out, ref, dtype, f"decode partitions={parts} seed={seed}")


def _unpipelined(variant: str) -> str | None:
    """The variant that runs ``variant``'s kernel without the software pipeline and with the same split
    rule, if there is one (pipe -> base, pipe_w8 -> w8, pipe_split8 -> split8; pipe_half has none)."""
    spec = DECODE_VARIANTS[variant]
    kernel = DECODE_KERNELS[spec.kernel]
    if not kernel.pipeline:
        return None
    plain = dataclasses.replace(kernel, pipeline=False)
    return next((v for v, s in DECODE_VARIANTS.items() if DECODE_KERNELS[s.kernel] == plain and s.split == spec.split),
                None)


def test_every_decode_variant_is_emulated():
    """A variant added to launchers.DECODE_VARIANTS gets configs here, or this fails; the pipelined ones
    that have a twin are held to its bits."""
    assert set(VARIANT_CONFIGS) == set(DECODE_VARIANTS) - {"base"}
    assert {v: _unpipelined(v) for v in DECODE_VARIANTS if _unpipelined(v)} == \
        {"pipe": "base", "pipe_w8": "w8", "pipe_split8": "split8"}


@pytest.mark.parametrize("variant, cfg", VARIANT_CASES, ids=[f"{v}-{IDS[CONFIGS.index(c)]}" for v, c in VARIANT_CASES])
def test_emulated_decode_variants(emu, variant, cfg):
    """Every decode variant against the float64 reference, on contexts spanning several tile rounds
    of its warps: single pass and the variant's own split rule (which splits these: 32-token
    partitions for the split-rule variants, 128 for the rest). Pipelining moves loads, not
    arithmetic: a pipelined variant gives its unpipelined twin's bits where it has one (single pass:
    the longest run of tiles per warp)."""
    dtype, head, bs, nq, nkv = cfg
    ctx = [1, bs + 1, 70, 300]
    seed = random.randrange(1 << 30)
    case = make_case(ctx, [1] * len(ctx), nq, nkv, head, bs, DTYPES[dtype], "cpu", seed=seed)
    emu.reshape_and_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    ref = ref_attention(case.query, case.k_cache, case.v_cache, case.block_tables, ctx, case.starts, SCALE)
    twin = _unpipelined(variant)
    for parts in (1, None):  # None: the variant's split rule
        outs = []
        for v in (variant, twin) if twin and parts == 1 else (variant,):
            out = torch.full_like(case.query, float("nan"))
            ran = emu.decode(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, max(ctx),
                             SCALE, out, num_partitions=parts, variant=v)
            outs.append(out)
        _check(outs[0], ref, dtype, f"decode {variant} partitions={parts} ran={ran} seed={seed}")
        if parts is None:
            assert ran == ((10, 32) if DECODE_VARIANTS[variant].split else (3, 128)), f"split {ran}"
        if len(outs) == 2:
            assert torch.equal(outs[0], outs[1]), f"{variant} differs from {twin} (partitions={parts} seed={seed})"


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_emulated_prefill_chunks(emu, cfg):
    dtype, head, bs, nq, nkv = cfg
    ctx, qs = [21, 50, 9, bs], [21, 7, 1, bs - 2]  # fresh prompt, chunk over a prefix, decode row
    seed = random.randrange(1 << 30)
    case = make_case(ctx, qs, nq, nkv, head, bs, DTYPES[dtype], "cpu", seed=seed)
    ref_reshape_and_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    ref = ref_attention(case.query, case.k_cache, case.v_cache, case.block_tables, ctx, case.starts, SCALE)
    for kernel in ("simt", "auto") if mma_prefill_supported(dtype, head) else ("auto",):  # auto: tensor cores
        out = torch.full_like(case.query, float("nan"))
        emu.prefill(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                    case.query_start_loc, max(qs), max(ctx), SCALE, out, kernel=kernel)
        _check(out, ref, dtype, f"prefill ({kernel}) seed={seed}")


def test_emulated_reshape_and_cache_skips_negative_slots(emu):
    case = make_case([9, 4], [9, 4], 4, 2, 80, 8, torch.bfloat16, "cpu", seed=random.randrange(1 << 30))
    case.slot_mapping[3] = -1
    fused = torch.randn(case.key.shape[0], 3, 2 * 80).bfloat16()
    key = fused[:, 1].view(-1, 2, 80)  # a strided slice, as from a fused QKV projection
    key.copy_(case.key)
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    ref_reshape_and_cache(key, case.value, k_ref, v_ref, case.slot_mapping)
    emu.reshape_and_cache(key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    torch.testing.assert_close(case.k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(case.v_cache, v_ref, rtol=0, atol=0, equal_nan=True)


def test_emulated_copy_blocks(emu):
    caches = [(torch.randn(6, 8, 2, 64), torch.randn(6, 8, 2, 64)) for _ in range(2)]
    pairs = [(0, 3), (5, 1)]
    expected = [(k.clone(), v.clone()) for k, v in caches]
    ref_copy_blocks(expected, pairs)
    emu.copy_blocks(caches, pairs)
    for (k, v), (ek, ev) in zip(caches, expected, strict=True):
        assert torch.equal(k, ek) and torch.equal(v, ev)


PROMPTS = [[(5 * i + 2) % 300 + 1 for i in range(n)] for n in (11, 4, 19)]


def _generate(runner) -> list[list[int]]:
    from testing.executor_plans import PlanDriver

    drv = PlanDriver(runner)
    for sid, p in enumerate(PROMPTS):
        drv.add(sid, p)
    drv.run_until(5, chunk=7)
    return [drv.seqs[sid].outputs for sid in range(len(PROMPTS))]


def test_emulated_backend_generates_like_the_torch_backend(emu, tiny_llama_dir, monkeypatch):
    """The runner with CupyAttentionBackend (kernels emulated on the CPU) decodes the tiny model
    exactly as with the torch backend: chunked prefill over cached blocks, batched decode."""
    from executor_svc.attention_cupy import CupyAttentionBackend
    from testing.executor_plans import make_runner

    emulate_launchers(emu, monkeypatch)
    outputs = []
    for cupy_backend in (True, False):
        runner = make_runner(tiny_llama_dir)
        if cupy_backend:
            runner.backend = CupyAttentionBackend()
        outputs.append(_generate(runner))
    assert outputs[0] == outputs[1]


def test_emulated_kernels_take_per_rank_head_counts(emu, tiny_llama_dir, monkeypatch):
    """Two tensor-parallel ranks, each with the CuPy backend on its own 2 q / 1 KV heads (the
    kernels see the per-rank shapes), generate what one torch-backed runner does."""
    from executor_svc.attention_cupy import CupyAttentionBackend
    from testing.executor_plans import make_runner
    from testing.tp_harness import tp_runner

    emulate_launchers(emu, monkeypatch)
    with tp_runner(tiny_llama_dir, backend=CupyAttentionBackend) as runner:
        assert [(r.model.cfg.num_heads, r.kv.layers[0][0].shape[2]) for r in [runner, *runner.followers]] == \
            [(2, 1), (2, 1)]
        sharded = _generate(runner)
    assert sharded == _generate(make_runner(tiny_llama_dir, cpu_attention="torch"))


@pytest.mark.parametrize("cfg, variant", [(("bfloat16", 128, 16, 8, 2), "auto"), (("float32", 64, 16, 16, 1), "auto"),
                                          (("bfloat16", 128, 16, 8, 2), "pipe_w8")],
                         ids=["bf16-gqa4", "f32-mqa", "bf16-gqa4-pipe_w8"])
def test_emulated_batch_invariant_backend_gives_a_request_its_bits_alone(emu, cfg, variant, monkeypatch):
    """The case make gpu-check runs on the GPU (testing/kernels/invariance.py): a request's rows alone,
    in a batch, in other chunks and as decode steps are the same bits through the batch-invariant
    backend, and close to the float64 reference; the default backend's differ (prefill and decode
    kernels, the split fitted to the launch). A decode variant (8 warps, pipelined) keeps it too."""
    from cupy_kernels import launchers
    from executor_svc.attention_cupy import CupyAttentionBackend
    from testing.kernels import invariance as inv

    dtype, head, bs, nq, nkv = cfg
    emulate_launchers(emu, monkeypatch, decode_variant=variant)
    monkeypatch.setattr(launchers, "INVARIANT_PARTITION", 64)  # the same splits on shorter contexts
    seed = random.randrange(1 << 30)
    case = inv.batch_case(nq, nkv, head, bs, DTYPES[dtype], "cpu", seed, inv.SMALL)
    outs = inv.request_alone_and_in_a_batch(CupyAttentionBackend(batch_invariant=True), case)
    assert inv.differences(outs) == [], f"seed {seed}"
    ref = ref_attention(case.query, case.k_cache, case.v_cache, case.block_tables, case.ctx_lens, case.starts,
                        inv.SCALE)
    rows = slice(case.starts[inv.R], case.starts[inv.R] + case.q_lens[inv.R])
    _check(outs["alone"], ref[rows], dtype, f"batch-invariant rows seed={seed}")
    assert inv.differences(inv.request_alone_and_in_a_batch(CupyAttentionBackend(), case)) != []
