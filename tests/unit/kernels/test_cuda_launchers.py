"""CPU tests of the CUDA launchers' argument checks, configuration choices and references.

No GPU needed: planning and validation look only at tensor metadata, and the references are
checked against dense attention so the GPU tests compare kernels with something trustworthy.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cupy_kernels import build, cache_ops, launchers
from testing.kernels.cases import make_case
from testing.kernels.nvcc import nvcc_unit
from testing.kernels.reference import ref_attention, ref_copy_blocks, ref_reshape_and_cache, rel_error


def _decode_args(**over):
    case = make_case([5, 40], [1, 1], 8, 2, 128, 16, torch.bfloat16, "cpu", seed=1, poison=False)
    args = dict(query=case.query, k_cache=case.k_cache, v_cache=case.v_cache,
                block_tables=case.block_tables, seq_lens=case.seq_lens, max_seq_len=40)
    args.update(over)
    return args


def test_group_size_and_prefill_tokens():
    assert [build.group_size(r) for r in (1, 2, 4, 7, 8, 12, 16, 32)] == [1, 2, 4, 7, 8, 6, 8, 8]
    assert [build.prefill_tokens(g) for g in (1, 4, 6, 8)] == [16, 4, 2, 2]
    with pytest.raises(ValueError, match="q_per_kv"):
        build.group_size(0)


def test_decode_split_rule():
    sms, split = 132, launchers.decode_split
    assert split(1, 8, 100, sms) == (1, 100)  # tiny context: one pass
    assert split(1, 8, 512, sms) == (4, 128)  # 8 blocks: short partitions to fill 132 SMs
    assert split(1, 8, 2048, sms) == (16, 128)  # partitions of at least 128 tokens
    assert split(8, 8, 2048, sms) == (8, 256)  # 64 blocks x 9 wanted -> 256-token partitions
    assert split(64, 8, 2048, sms) == (4, 512)  # 512 blocks < 4 * 132
    assert split(64, 8, 512, sms) == (2, 256)
    assert split(128, 8, 2048, sms) == (1, 2048)  # 1024 blocks keep every SM busy
    assert split(128, 8, 8193, sms) == (17, 512)  # very long: always split
    for seqs, ctx in [(1, 777), (3, 5000), (64, 8192), (200, 300)]:
        parts, size = split(seqs, 8, ctx, sms)
        assert parts * size >= ctx and (parts == 1 or (parts - 1) * size < ctx)


def test_decode_split_rule_parameters():
    """A variant's rule: more blocks per SM and shorter partitions give a small batch more blocks; the
    defaults are the base rule."""
    sms, split = 132, launchers.decode_split
    assert split(1, 8, 2048, sms, blocks_per_sm=8, min_partition=32) == (64, 32)  # 512 blocks, not 128
    assert split(8, 8, 8192, sms, blocks_per_sm=8, min_partition=32) == (16, 512)  # held at PARTITION_SIZE
    assert split(64, 8, 2048, sms, blocks_per_sm=8) == (4, 512)
    assert split(1, 8, 100, sms, min_partition=32) == (4, 32)  # short contexts split too
    assert split(1, 8, 2048, sms, blocks_per_sm=4, min_partition=128) == split(1, 8, 2048, sms)
    for seqs, ctx in [(1, 777), (3, 5000), (64, 8192), (200, 300), (1, 33)]:
        parts, size = split(seqs, 8, ctx, sms, blocks_per_sm=8, min_partition=32)
        assert parts * size >= ctx and (parts == 1 or ((parts - 1) * size < ctx and size % 32 == 0))
    with pytest.raises(ValueError, match="blocks_per_sm"):
        split(1, 8, 2048, sms, blocks_per_sm=0)


def test_plan_decode_variants():
    """"auto" is today's kernel and rule; a named variant runs its kernel (explicit template arguments)
    with its split rule; 8 warps fall back to 4 where their merge would overflow shared memory."""
    auto = launchers.plan_decode(**_decode_args(), num_sms=132)
    assert launchers.plan_decode(**_decode_args(), num_sms=132, variant="base") == auto
    assert auto[0].key.variant == "base" and auto[0].key.threads == 128
    pipe, parts, size = launchers.plan_decode(**_decode_args(), num_sms=132, variant="pipe")
    assert pipe.key.expression() == "ps_paged_decode<__nv_bfloat16, 128, 16, 4, 4, 2, true>"
    assert (pipe.grid, parts, size) == (auto[0].grid, *auto[1:])
    w8 = launchers.plan_decode(**_decode_args(), num_sms=132, variant="w8")[0].key
    assert w8.threads == 256 and w8.expression().endswith(", 8, 2, false>")
    assert launchers.plan_decode(**_decode_args(), num_sms=132, variant="nt2")[0].key.expression().endswith(", 4, 4, false>")
    assert launchers.plan_decode(**_decode_args(), num_sms=132, variant="pipe_half")[0].key.expression().endswith(
        ", 4, 1, true>")
    split8 = launchers.plan_decode(**_decode_args(), num_sms=132, variant="split8")
    assert split8[0].key == auto[0].key and split8[1:] == (2, 32)  # the base kernel, its own split
    big = build.KernelKey("decode", "float32", 256, 16, 8, variant="pipe_w8")
    assert big.threads == 128 and big.expression() == "ps_paged_decode<float, 256, 16, 8, 4, 2, true>"
    assert build.KernelKey("decode", "float32", 128, 16, 8, variant="w8").threads == 256
    with pytest.raises(ValueError, match="variant: 'auto' or one of"):
        launchers.plan_decode(**_decode_args(), num_sms=132, variant="fast")
    with pytest.raises(ValueError, match="decode kernel variant"):
        build.KernelKey("decode", "float32", 128, 16, 8, variant="fast").expression()


def test_a_fixed_split_size_cuts_every_context_alike_whatever_the_batch():
    """The batch-invariant split: partitions of the given size whatever the launch holds, so a
    sequence's cut points depend on its own length only (the split rule's follow the batch)."""
    assert launchers.fixed_split(2048, 256) == (8, 256)
    assert launchers.fixed_split(257, 256) == (2, 256) and launchers.fixed_split(256, 256) == (1, 256)
    assert launchers.plan_decode(**_decode_args(), num_sms=132, partition_size=256)[1:] == (1, 256)
    # The rule's size follows the batch: 8 and 64 sequences of 2048 tokens are cut at 256 and 512.
    assert launchers.decode_split(8, 8, 2048, 132)[1] != launchers.decode_split(64, 8, 2048, 132)[1]
    with pytest.raises(ValueError, match="partition_size: a positive multiple of 64"):
        launchers.fixed_split(100, 100)


def test_plan_decode_picks_configuration():
    launch, parts, size = launchers.plan_decode(**_decode_args(), num_sms=132)
    assert launch.key == build.KernelKey("decode", "bfloat16", 128, 16, 4)
    assert launch.grid == (2, 2, 1) and (parts, size) == (1, 40)
    assert launch.key.expression() == "ps_paged_decode<__nv_bfloat16, 128, 16, 4>"


@pytest.mark.parametrize("change, field", [
    (lambda a: a.update(k_cache=a["k_cache"].float(), v_cache=a["v_cache"].float()), "query"),
    (lambda a: a.update(v_cache=a["v_cache"][:, :, :, :64].contiguous()), "v_cache"),
    (lambda a: a.update(k_cache=a["k_cache"].transpose(1, 2)), "k_cache"),
    (lambda a: a.update(k_cache=a["k_cache"].to(torch.int16)), "k_cache"),
    (lambda a: a.update(query=a["query"][:, :7]), "query"),
    (lambda a: a.update(query=a["query"][:1]), "query"),
    (lambda a: a.update(seq_lens=a["seq_lens"].long()), "seq_lens"),
    (lambda a: a.update(block_tables=a["block_tables"][:1]), "block_tables"),
    (lambda a: a.update(block_tables=a["block_tables"].t().contiguous().t()), "block_tables"),
    (lambda a: a.update(max_seq_len=10_000), "max_seq_len"),
    (lambda a: a.update(query=a["query"].transpose(1, 2).contiguous().transpose(1, 2)), "query"),
])
def test_plan_decode_rejects_bad_arguments(change, field):
    args = _decode_args()
    change(args)
    with pytest.raises(ValueError, match=f"^{field}"):
        launchers.plan_decode(**args, num_sms=132)


def test_unsupported_head_and_block_sizes_are_named():
    for shape, word in (((4, 16, 2, 48), "head_size"), ((4, 12, 2, 64), "block_size")):
        c = torch.zeros(shape)
        with pytest.raises(ValueError, match=word):
            launchers.plan_decode(torch.zeros(1, 4, shape[3]), c, c, torch.zeros(1, 4, dtype=torch.int32),
                                  torch.ones(1, dtype=torch.int32), 1, num_sms=1)


def test_query_slice_of_fused_projection_is_accepted():
    """A q view into a [tokens, (q + 2 kv) heads * head] projection has a longer row stride."""
    args = _decode_args()
    fused = torch.randn(2, 12 * 128).to(torch.bfloat16)
    args["query"] = fused[:, : 8 * 128].view(2, 8, 128)
    launchers.plan_decode(**args, num_sms=132)


def test_plan_prefill_grid_and_checks():
    case = make_case([20, 7], [4, 7], 12, 4, 80, 8, torch.float16, "cpu", seed=2, poison=False)
    launch = launchers.plan_prefill(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                    case.query_start_loc, 7, 20, kernel="simt")
    assert launch.key == build.KernelKey("prefill", "float16", 80, 8, 3, 5)
    assert launch.grid == (4, 2, 2)
    with pytest.raises(ValueError, match="^query_start_loc"):
        launchers.plan_prefill(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                               case.query_start_loc[:-1], 7, 20)
    with pytest.raises(ValueError, match="^max_query_len"):
        launchers.plan_prefill(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                               case.query_start_loc, 12, 20)


def test_plan_prefill_picks_the_tensor_cores_for_half_types():
    """f16/bf16 at heads up to 128 take the 64-row mma kernel (64 // group tokens a tile); float32
    and head 256 keep the SIMT kernel, and asking for the tensor cores there is an error."""
    def plan(dtype, head, nq, nkv, kernel="auto", max_q=7):
        case = make_case([20, 7], [4, 7], nq, nkv, head, 8, dtype, "cpu", seed=2, poison=False)
        return launchers.plan_prefill(case.query, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                      case.query_start_loc, max_q, 20, kernel=kernel)

    assert plan(torch.float16, 80, 12, 4).key == build.KernelKey("prefill_mma", "float16", 80, 8, 3, 21)
    launch = plan(torch.bfloat16, 128, 8, 2, max_q=7)
    assert launch.key == build.KernelKey("prefill_mma", "bfloat16", 128, 8, 4, 16) and launch.grid == (2, 2, 1)
    assert plan(torch.bfloat16, 16, 4, 4).grid == (4, 2, 1)  # 64 tokens a tile
    assert plan(torch.float32, 128, 8, 2).key.kind == "prefill"
    assert plan(torch.bfloat16, 256, 8, 2).key.kind == "prefill"
    assert plan(torch.bfloat16, 128, 8, 2, kernel="simt").key.kind == "prefill"
    with pytest.raises(ValueError, match="^kernel: the tensor-core prefill"):
        plan(torch.float32, 128, 8, 2, kernel="mma")
    with pytest.raises(ValueError, match="^kernel: one of"):
        plan(torch.bfloat16, 128, 8, 2, kernel="tc")


def test_launchers_refuse_cpu_tensors_before_touching_cupy():
    with pytest.raises(ValueError, match="CUDA tensors"):
        launchers.paged_attention_decode(**_decode_args(), scale=0.1)
    case = make_case([3], [3], 4, 4, 64, 8, torch.float32, "cpu", seed=3, poison=False)
    with pytest.raises(ValueError, match="CUDA tensors"):
        cache_ops.reshape_and_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    with pytest.raises(ValueError, match="CUDA tensors"):
        cache_ops.copy_blocks([(case.k_cache, case.v_cache)], [(0, 1)])


def test_reshape_and_cache_checks():
    case = make_case([3], [3], 4, 4, 64, 8, torch.float32, "cpu", seed=3, poison=False)
    with pytest.raises(ValueError, match="^slot_mapping"):
        cache_ops.check_reshape_and_cache(case.key, case.value, case.k_cache, case.v_cache,
                                          case.slot_mapping.int())
    with pytest.raises(ValueError, match="^value"):
        cache_ops.check_reshape_and_cache(case.key, case.value[:2], case.k_cache, case.v_cache, case.slot_mapping)
    with pytest.raises(ValueError, match="^key"):
        cache_ops.check_reshape_and_cache(case.key.half(), case.value, case.k_cache, case.v_cache,
                                          case.slot_mapping)


def test_copy_blocks_pair_checks():
    c = torch.zeros(4, 8, 1, 64)
    for pairs, word in (([(0, 4)], "out of range"), ([(0, 1), (2, 1)], "twice"), ([(0, 1), (1, 2)], "both")):
        with pytest.raises(ValueError, match=word):
            cache_ops.copy_blocks([(c, c.clone())], pairs)


def test_swap_blocks_between_pools_matches_reference():
    """Swapping needs no kernel, so it runs on CPU pools too (the GPU test covers pinned host)."""
    gen = torch.Generator().manual_seed(4)
    src = [(torch.randn(6, 8, 2, 64, generator=gen), torch.randn(6, 8, 2, 64, generator=gen)) for _ in range(2)]
    dst = [(torch.full((5, 8, 2, 64), float("nan")), torch.full((5, 8, 2, 64), float("nan"))) for _ in range(2)]
    pairs = [(0, 1), (1, 2), (5, 0), (3, 4)]
    cache_ops.swap_blocks(src, dst, pairs)
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        for s, d in pairs:
            assert torch.equal(dk[d], sk[s]) and torch.equal(dv[d], sv[s])
        assert torch.isnan(dk[3]).all()  # untouched
    assert cache_ops._runs(pairs) == [(0, 1, 2), (5, 0, 1), (3, 4, 1)]
    with pytest.raises(ValueError, match="^dst_caches"):
        cache_ops.swap_blocks(src, dst[:1], pairs)


def test_reference_matches_dense_causal_attention():
    """ref_attention over a shuffled paged cache == SDPA over the contiguous context."""
    case = make_case([37, 9, 64], [5, 9, 1], 8, 2, 64, 8, torch.float32, "cpu", seed=5)
    ref_reshape_and_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    out = ref_attention(case.query, case.k_cache, case.v_cache, case.block_tables, case.ctx_lens,
                        case.starts, scale=0.125)
    starts = case.starts
    for i, length in enumerate(case.ctx_lens):
        lo, hi = starts[i], starts[i + 1]
        tokens = torch.arange(length)
        blocks = case.block_tables[i].long()[tokens // 8]
        k = case.k_cache[blocks, tokens % 8].double().transpose(0, 1)  # [kv_heads, L, d]
        v = case.v_cache[blocks, tokens % 8].double().transpose(0, 1)
        q = case.query[lo:hi].double().transpose(0, 1)
        mask = torch.ones(hi - lo, length, dtype=torch.bool).tril(diagonal=length - (hi - lo))
        dense = F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=0.125,
                                               enable_gqa=True)[0].transpose(0, 1)
        assert rel_error(out[lo:hi], dense) < 1e-12
    assert not torch.isnan(out).any()


def test_reference_copy_blocks_reads_before_writing():
    k = torch.arange(4.0).view(4, 1, 1, 1).expand(4, 8, 1, 16).contiguous()
    caches = [(k, k.clone())]
    ref_copy_blocks(caches, [(0, 2), (1, 3)])
    assert caches[0][0][:, 0, 0, 0].tolist() == [0.0, 1.0, 0.0, 1.0]


def test_rel_error_never_passes_nan():
    assert rel_error(torch.tensor([float("nan"), 1.0]), torch.ones(2)) == float("inf")


def test_nvcc_unit_names_every_instance():
    keys = [build.KernelKey("decode", "float16", 64, 8, 2), build.KernelKey("prefill", "float32", 96, 32, 1, 16)]
    unit = nvcc_unit("paged_decode.cu", keys)
    assert "&ps_paged_decode<__half, 64, 8, 2>" in unit
    assert "&ps_paged_prefill<float, 96, 32, 1, 16>" in unit
    src = build.read_source("paged_decode.cu")
    assert '#include "common.cuh"' not in src and "struct Cvt<__nv_bfloat16>" in src


def test_kv_budget_takes_the_share_minus_peak_and_non_torch():
    from executor_svc.gpu_memory import kv_budget

    gib = 1 << 30
    assert kv_budget(80 * gib, 20 * gib, gib, 0.9) == int(0.9 * 80 * gib) - 21 * gib
    assert kv_budget(10 * gib, 12 * gib, 0, 0.9) == 0  # the model alone is over the share
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget(gib, 0, 0, 1.5)


def test_profile_step_runs_a_full_forward(tiny_llama_dir):
    """The profiling step builds valid metadata for the token budget (checked here on CPU)."""
    from executor_svc.attention import TorchAttentionBackend
    from executor_svc.gpu_memory import make_profile_step
    from executor_svc.model import load_model

    model = load_model(tiny_llama_dir)
    calls = []
    backend = TorchAttentionBackend()
    forward = backend.forward
    backend.forward = lambda q, *a, **k: calls.append(q.shape) or forward(q, *a, **k)
    make_profile_step(model, backend, num_tokens=37, block_size=16)()
    assert calls and all(shape[0] == 37 for shape in calls)


def test_profile_step_runs_on_a_tensor_parallel_rank_without_the_lm_head(tiny_llama_dir):
    """Every rank of a CUDA group profiles its step; ranks above 0 hold no LM head (checked on CPU,
    the shard alone: the sum over ranks does not change which layers run)."""
    from executor_svc.attention import TorchAttentionBackend
    from executor_svc.gpu_memory import make_profile_step
    from executor_svc.model import load_model
    from executor_svc.parallel.shard import TPShard

    model = load_model(tiny_llama_dir, shard=TPShard(1, 2))
    assert not model.with_lm_head
    make_profile_step(model, TorchAttentionBackend(), num_tokens=37, block_size=16)()


def test_compile_cache_groups_instantiations_and_never_recompiles(monkeypatch):
    """precompile/get_function against a stand-in for CuPy: one RawModule per chunk of
    instantiations of a source, every key resolvable afterwards, nothing compiled twice."""
    import contextlib
    import sys
    import types

    compiled = []

    class FakeModule:
        def __init__(self, code, options, name_expressions=()):
            compiled.append((code, tuple(name_expressions)))
            self.names = set(name_expressions)

        def get_function(self, name):
            assert name in self.names or not self.names, name
            return ("fn", name)

    fake = types.SimpleNamespace(RawModule=FakeModule,
                                 cuda=types.SimpleNamespace(Device=lambda i: contextlib.nullcontext()))
    monkeypatch.setitem(sys.modules, "cupy", fake)
    monkeypatch.setattr(build, "_MODULES", {})
    keys = [build.KernelKey("decode", "float16", h, 16, 4) for h in build.HEAD_SIZES]
    keys += [build.KernelKey("prefill", "float32", 64, 8, 2, 8), build.KernelKey("cache_ops")]
    build.precompile(keys + keys[:2], device_id=0, chunk=4)
    assert sorted(len(names) for _, names in compiled) == [0, 1, 3, 4]  # cache_ops, prefill, 7 decodes
    assert all("struct Cvt<__half>" in code for code, _ in compiled)
    n = len(compiled)
    for k in keys[:-1]:
        assert build.get_function(k, 0) == ("fn", k.expression())
    assert len(compiled) == n  # all served from the cache
    build.get_function(build.KernelKey("decode_reduce", "float16", 64), 0)
    assert compiled[-1][1] == ("ps_paged_decode_reduce<__half, 64>",)
