"""GPU tests of the CUDA kernels against the float64 references (skipped without CUDA + CuPy).

Fresh random inputs per case (never zeros), shuffled block tables, caches poisoned with NaN
outside the written slots and outputs poisoned with NaN before each launch, so an unwritten
output or a read of a slot nobody wrote fails the tolerance. Grid: every dtype x head size
(block 16, GQA 4), plus block sizes 8/32, MHA, MQA and odd group sizes on the Llama shape;
context lengths include non-multiples of the block size, single-pass and split decode.
"""

from __future__ import annotations

import importlib.util
import random

import pytest
import torch

from cupy_kernels.build import (
    CUDA_TYPES,
    DECODE_KERNELS,
    HEAD_SIZES,
    PREFILL_MMA_KERNELS,
    KernelKey,
    group_size,
    mma_prefill_supported,
    precompile,
    prefill_mma_tokens,
    prefill_tokens,
)
from cupy_kernels.launchers import DECODE_VARIANTS
from testing.kernels.cases import make_case
from testing.kernels.reference import ref_attention, ref_copy_blocks, ref_reshape_and_cache, rel_error

_HAVE_GPU = torch.cuda.is_available() and importlib.util.find_spec("cupy") is not None
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not _HAVE_GPU, reason="needs a CUDA GPU and CuPy (run make gpu-check)")]

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TOL = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1e-2}
# (dtype, head_size, block_size, num_q_heads, num_kv_heads)
CONFIGS = [(d, h, 16, 8, 2) for d in CUDA_TYPES for h in HEAD_SIZES] + [
    ("bfloat16", 128, 8, 8, 2), ("bfloat16", 128, 32, 8, 2),   # block sizes
    ("bfloat16", 128, 16, 4, 4), ("bfloat16", 128, 16, 8, 1),  # MHA, MQA
    ("float16", 96, 16, 14, 2), ("float32", 64, 8, 32, 1),     # group 7; group 8 x 4 chunks
    ("bfloat16", 80, 32, 12, 1),                               # group 6 x 2 chunks
]
IDS = [f"{d}-h{h}-b{b}-q{q}kv{kv}" for d, h, b, q, kv in CONFIGS]
SCALE = 0.0883
# Decode variants (launchers.DECODE_VARIANTS): the Llama-3-8B shape, odd head / group / block, head 256
# with group 8 (the 8-warp kernels fall back to 4 warps there). Few: each adds 5 kernels to compile.
VARIANT_CONFIGS = [("bfloat16", 128, 16, 32, 8), ("float32", 80, 8, 12, 4), ("float16", 256, 32, 16, 2)]


@pytest.fixture(scope="module", autouse=True)
def _compile_all():
    """Compile every configuration used below in parallel once (minutes serially)."""
    if not _HAVE_GPU:
        return
    keys = []
    for d, h, b, q, kv in CONFIGS:
        g = group_size(q // kv)
        keys += [KernelKey("decode", d, h, b, g), KernelKey("decode_reduce", d, h),
                 KernelKey("prefill", d, h, b, g, prefill_tokens(g))]
        if mma_prefill_supported(d, h):
            keys += [KernelKey("prefill_mma", d, h, b, g, prefill_mma_tokens(g), variant=v)
                     for v in PREFILL_MMA_KERNELS]
    for d, h, b, q, kv in VARIANT_CONFIGS:
        keys += [KernelKey("decode", d, h, b, group_size(q // kv), variant=v) for v in DECODE_KERNELS]
        keys.append(KernelKey("decode_reduce", d, h))
    precompile([*keys, KernelKey("cache_ops")], torch.cuda.current_device())


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: str, what: str) -> None:
    err = rel_error(out, ref)
    assert err < TOL[dtype], f"{what}: relative error {err:.3g} >= {TOL[dtype]}"


def _seed() -> int:
    """A fresh seed per case; pytest shows it in the failing test's locals (-l) for a rerun."""
    return random.randrange(1 << 30)


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_decode_single_and_split(cfg):
    from cupy_kernels.launchers import paged_attention_decode

    dtype, head, bs, nq, nkv = cfg
    ctx = [1, bs - 1, bs + 1, 3 * bs + 5, 700, 1100]
    case = make_case(ctx, [1] * len(ctx), nq, nkv, head, bs, DTYPES[dtype], "cuda", seed=(seed := _seed()))
    ref_reshape_and_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    ref = ref_attention(case.query, case.k_cache, case.v_cache, case.block_tables, ctx, case.starts, SCALE)
    for parts in (1, 3, None):  # single pass, forced split, the launcher's rule
        out = torch.full_like(case.query, float("nan"))
        paged_attention_decode(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                               max(ctx), SCALE, out=out, num_partitions=parts)
        _check(out, ref, dtype, f"decode partitions={parts} seed={seed}")


@pytest.mark.parametrize("variant", [v for v in DECODE_VARIANTS if v != "base"])
@pytest.mark.parametrize("cfg", VARIANT_CONFIGS, ids=lambda c: f"{c[0]}-h{c[1]}-b{c[2]}-q{c[3]}kv{c[4]}")
def test_decode_variants_match_reference(cfg, variant):
    """Every decode variant (make gpu-check times them) against the float64 reference: contexts over
    many tiles of every warp, single pass, a forced split and the variant's own split rule."""
    from cupy_kernels.launchers import paged_attention_decode

    dtype, head, bs, nq, nkv = cfg
    ctx = [1, bs - 1, bs + 1, 3 * bs + 5, 700, 1100, 2900]
    case = make_case(ctx, [1] * len(ctx), nq, nkv, head, bs, DTYPES[dtype], "cuda", seed=(seed := _seed()))
    ref_reshape_and_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    ref = ref_attention(case.query, case.k_cache, case.v_cache, case.block_tables, ctx, case.starts, SCALE)
    for parts in (1, 3, None):
        out = torch.full_like(case.query, float("nan"))
        paged_attention_decode(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                               max(ctx), SCALE, out=out, num_partitions=parts, variant=variant)
        _check(out, ref, dtype, f"decode {variant} partitions={parts} seed={seed}")


@pytest.mark.parametrize("cfg", CONFIGS, ids=IDS)
def test_prefill_chunks_over_cached_prefix(cfg):
    from cupy_kernels.launchers import paged_attention_prefill

    dtype, head, bs, nq, nkv = cfg
    ctx = [37, 100, 33, 5, 2 * bs, 300]
    qs = [37, 13, 1, 5, 2 * bs - 3, 41]  # fresh prompt, chunk on a prefix, decode row, ...
    case = make_case(ctx, qs, nq, nkv, head, bs, DTYPES[dtype], "cuda", seed=(seed := _seed()))
    ref_reshape_and_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    ref = ref_attention(case.query, case.k_cache, case.v_cache, case.block_tables, ctx, case.starts, SCALE)
    # auto: the tensor-core kernel where it applies (f16/bf16, head <= 128); simt: the SIMT kernel;
    # mma_pipe: the tensor cores with cp.async-pipelined K/V tiles
    for kernel in ("auto", "simt", "mma_pipe") if mma_prefill_supported(dtype, head) else ("auto",):
        out = torch.full_like(case.query, float("nan"))
        paged_attention_prefill(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                case.query_start_loc, max(qs), max(ctx), SCALE, out=out, kernel=kernel)
        _check(out, ref, dtype, f"prefill ({kernel}) seed={seed}")


@pytest.mark.parametrize("cfg", [("bfloat16", 128, 16, 32, 8), ("float16", 64, 32, 8, 8), ("bfloat16", 96, 16, 14, 2)],
                         ids=lambda c: f"{c[0]}-h{c[1]}-b{c[2]}-q{c[3]}kv{c[4]}")
def test_prefill_long_prompts_tensor_cores_and_simt(cfg):
    """Prompts of many 64-token K/V tiles (a fresh 1000-token prompt, a 200-token chunk over a
    313-token prefix, a prompt ending mid-tile): the tensor-core kernels (plain and pipelined) and the
    SIMT kernel."""
    from cupy_kernels.launchers import paged_attention_prefill

    dtype, head, bs, nq, nkv = cfg
    ctx, qs = [1000, 513, 130], [1000, 200, 130]
    case = make_case(ctx, qs, nq, nkv, head, bs, DTYPES[dtype], "cuda", seed=(seed := _seed()))
    ref_reshape_and_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    ref = ref_attention(case.query, case.k_cache, case.v_cache, case.block_tables, ctx, case.starts, SCALE)
    for kernel in ("mma", "mma_pipe", "simt"):
        out = torch.full_like(case.query, float("nan"))
        paged_attention_prefill(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                case.query_start_loc, max(qs), max(ctx), SCALE, out=out, kernel=kernel)
        _check(out, ref, dtype, f"prefill ({kernel}) seed={seed}")


@pytest.mark.parametrize("dtype", list(CUDA_TYPES))
@pytest.mark.parametrize("head", [64, 80, 256])
def test_reshape_and_cache_matches_reference(dtype, head):
    from cupy_kernels.cache_ops import reshape_and_cache

    case = make_case([9, 20, 3], [9, 4, 3], 4, 2, head, 8, DTYPES[dtype], "cuda", seed=head)
    case.slot_mapping[2] = -1  # a padded token: must not be written
    fused = torch.randn(case.key.shape[0], 3, 2 * head, device="cuda").to(DTYPES[dtype])
    key = fused[:, 0].view(-1, 2, head)  # row stride 3 * 2 * head: a slice of a fused projection
    key.copy_(case.key)
    k_ref, v_ref = case.k_cache.clone(), case.v_cache.clone()
    ref_reshape_and_cache(key, case.value, k_ref, v_ref, case.slot_mapping)
    reshape_and_cache(key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    torch.testing.assert_close(case.k_cache, k_ref, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(case.v_cache, v_ref, rtol=0, atol=0, equal_nan=True)


def test_copy_blocks_all_layers_one_launch():
    from cupy_kernels.cache_ops import copy_blocks

    caches = [(torch.randn(12, 16, 2, 80, device="cuda").half(), torch.randn(12, 16, 2, 80, device="cuda").half())
              for _ in range(3)]
    pairs = [(0, 5), (3, 7), (11, 2), (4, 9)]
    expected = [(k.clone(), v.clone()) for k, v in caches]
    ref_copy_blocks(expected, pairs)
    copy_blocks(caches, pairs)
    for (k, v), (ek, ev) in zip(caches, expected, strict=True):
        assert torch.equal(k, ek) and torch.equal(v, ev)


def test_swap_out_and_in_through_pinned_host_pool():
    from cupy_kernels.cache_ops import swap_blocks

    dev = [(torch.randn(10, 16, 2, 64, device="cuda").bfloat16(), torch.randn(10, 16, 2, 64, device="cuda").bfloat16())
           for _ in range(2)]
    host = [(torch.empty(6, 16, 2, 64, dtype=torch.bfloat16, pin_memory=True),
             torch.empty(6, 16, 2, 64, dtype=torch.bfloat16, pin_memory=True)) for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in dev]
    swap_blocks(dev, host, [(1, 0), (2, 1), (7, 5)])
    for k, v in dev:  # the device blocks get reused by someone else meanwhile
        k[1:3].normal_()
        v[7].normal_()
    swap_blocks(host, dev, [(0, 4), (1, 5), (5, 8)])
    torch.cuda.synchronize()
    for (k, v), (bk, bv) in zip(dev, before, strict=True):
        assert torch.equal(k[4:6], bk[1:3]) and torch.equal(v[8], bv[7])


@pytest.mark.parametrize("mode", ["decode", "mixed"])
def test_backend_matches_torch_backend(mode):
    from executor_svc.attention import AttentionMetadata, TorchAttentionBackend
    from executor_svc.attention_cupy import CupyAttentionBackend

    ctx, qs = ([40, 17, 300], [1, 1, 1]) if mode == "decode" else ([40, 17, 300], [40, 1, 25])
    case = make_case(ctx, qs, 8, 2, 128, 16, torch.bfloat16, "cuda", seed=7)
    meta = AttentionMetadata(case.slot_mapping, case.query_start_loc, case.seq_lens, case.block_tables,
                             max(qs), max(ctx), case.starts, ctx)
    outs = []
    for backend in (TorchAttentionBackend(), CupyAttentionBackend()):
        k, v = case.k_cache.nan_to_num(0.0), case.v_cache.nan_to_num(0.0)  # torch backend reads padding
        backend.write_kv(case.key, case.value, k, v, meta)
        outs.append(backend.forward(case.query, k, v, meta, SCALE))
    _check(outs[1], outs[0].float(), "bfloat16", f"cupy vs torch backend ({mode})")


@pytest.mark.parametrize("cfg", [(d, h, 16, 8, 2) for d in CUDA_TYPES for h in (64, 128)] + [("bfloat16", 128, 32, 32, 1)],
                         ids=lambda c: f"{c[0]}-h{c[1]}-b{c[2]}-q{c[3]}kv{c[4]}")
def test_batch_invariant_backend_gives_a_request_its_bits_alone(cfg):
    """testing/kernels/invariance.py on the GPU (the suite runs it on the emulator): a request's rows
    alone, in a batch, in other chunks and as decode steps, bit for bit."""
    from executor_svc.attention_cupy import CupyAttentionBackend
    from testing.kernels import invariance as inv

    dtype, head, bs, nq, nkv = cfg
    seed = _seed()
    case = inv.batch_case(nq, nkv, head, bs, DTYPES[dtype], "cuda", seed)
    outs = inv.request_alone_and_in_a_batch(CupyAttentionBackend(batch_invariant=True), case)
    assert inv.differences(outs) == [], f"seed {seed}"
    ref = ref_attention(case.query.cpu(), case.k_cache.cpu(), case.v_cache.cpu(), case.block_tables.cpu(),
                        case.ctx_lens, case.starts, inv.SCALE)
    rows = slice(case.starts[inv.R], case.starts[inv.R] + case.q_lens[inv.R])
    _check(outs["alone"].cpu(), ref[rows], dtype, f"rows seed={seed}")


def _gpu_runner(model_dir, dtype: torch.dtype):
    from executor_svc.attention_cupy import CupyAttentionBackend
    from executor_svc.kv_cache import KVCache
    from executor_svc.model import load_model
    from executor_svc.runner import ModelRunner
    from executor_svc.sampler import Sampler

    model = load_model(model_dir, "cuda", dtype)
    kv = KVCache(model.cfg, 16, 64, 0, dtype, "cuda")
    return ModelRunner(model, kv, CupyAttentionBackend(), Sampler(seed=0))


def test_greedy_generation_gpu_matches_cpu_and_transformers(tiny_llama_dir):
    """The tiny model through the runner with the CUDA kernels (float32, chunked prefill, batched
    decode) generates the same greedy tokens as the CPU torch path and transformers."""
    from transformers import AutoModelForCausalLM

    from testing.executor_plans import PlanDriver, hf_greedy, make_runner

    prompts = [[(7 * i + 3) % 200 + 1 for i in range(n)] for n in (23, 5, 40)]
    outputs = []
    for runner in (_gpu_runner(tiny_llama_dir, torch.float32), make_runner(tiny_llama_dir)):
        drv = PlanDriver(runner)
        for sid, p in enumerate(prompts):
            drv.add(sid, p)
        drv.run_until(12, chunk=9)  # prefill in chunks over cached blocks, then decode together
        outputs.append([drv.seqs[sid].outputs for sid in range(len(prompts))])
    assert outputs[0] == outputs[1], "GPU path differs from the CPU path"
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32)
    assert outputs[0] == [hf_greedy(hf, p, 12) for p in prompts], "GPU path differs from transformers"


def test_bfloat16_runner_logits_close_to_float32(tiny_llama_dir):
    from testing.executor_plans import PlanDriver

    logits = []
    for dtype in (torch.float32, torch.bfloat16):
        runner = _gpu_runner(tiny_llama_dir, dtype)
        runner.keep_logits = True
        drv = PlanDriver(runner)
        drv.add(0, list(range(1, 30)))
        drv.step({0: 29})
        logits.append(runner.last_logits.float().cpu())
    err = rel_error(logits[1], logits[0])
    assert err < 5e-2, f"bf16 logits differ from float32 by {err:.3g}"  # catches broken attention (~1)
