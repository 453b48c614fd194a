"""The fused CPU paged decode kernel against the torch backend, its compile cache and its fallback."""

from __future__ import annotations

import logging
import math
import shutil

import pytest
import torch

from executor_svc import cpu_kernels
from executor_svc.attention import AttentionMetadata, TorchAttentionBackend
from executor_svc.attention_cpu import FusedCpuAttentionBackend
from executor_svc.backends import make_attention_backend

KVH = 2


@pytest.fixture(scope="module")
def kernel() -> cpu_kernels.DecodeKernel:
    # No skip without a compiler: the served CPU default needs one (as the CUDA emulator tests
    # need g++), so a test machine without it is broken; build_library raises with the reason.
    # The no-compiler fallback itself is tested with the compiler monkeypatched away.
    return cpu_kernels.DecodeKernel(cpu_kernels.build_library("native"))


@pytest.fixture
def fresh_loader():
    """load_decode_kernel() memoises; tests that change the environment start and end clean."""
    cpu_kernels.load_decode_kernel.cache_clear()
    yield
    cpu_kernels.load_decode_kernel.cache_clear()


def _case(shapes: list[tuple[int, int]], group: int, head: int, block: int, seed: int = 0, kvh: int = KVH):
    """Random caches holding every sequence's context in shuffled blocks; shapes: (context, new tokens)."""
    g = torch.Generator().manual_seed(seed)
    tables = [-(-ctx // block) for ctx, _ in shapes]
    num_blocks = sum(tables) + 3
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(n)] for n in tables]
    k_cache = torch.randn(num_blocks, block, kvh, head, generator=g)
    v_cache = torch.randn(num_blocks, block, kvh, head, generator=g)
    starts = [0]
    for _, new in shapes:
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.full((starts[-1],), -1), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c for c, _ in shapes], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(n for _, n in shapes), max_seq_len=max(c for c, _ in shapes),
        query_start_loc_host=starts, seq_lens_host=[c for c, _ in shapes])
    query = torch.randn(starts[-1], kvh * group, head, generator=g)
    return query, k_cache, v_cache, meta


def _both(kernel, query, k_cache, v_cache, meta, head):
    scale = 1 / math.sqrt(head)
    ref = TorchAttentionBackend().forward(query, k_cache, v_cache, meta, scale)
    return FusedCpuAttentionBackend(kernel).forward(query, k_cache, v_cache, meta, scale), ref


@pytest.mark.parametrize("block", [8, 16, 32])
@pytest.mark.parametrize("head", [32, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_decode_matches_torch(kernel, group, head, block):
    # length 1, exactly one block, one past it, a non-multiple, and a long context
    lens = [1, block, block + 1, 3 * block - 5, 1000]
    out, ref = _both(kernel, *_case([(n, 1) for n in lens], group, head, block, seed=group + head + block), head)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.fixture
def isa_levels(kernel):
    """The instruction-set levels the kernel can use here, best first; the best again afterwards."""
    best = kernel.lib.ps_isa_level(0)  # PS_W_F32: what picks the decode unit
    yield list(range(best, -1, -1))
    kernel.lib.ps_set_isa_limit(2)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [8, 16, 32])
@pytest.mark.parametrize("head", [64, 128])
def test_every_instruction_set_gives_the_same_bits(kernel, isa_levels, head, block, kv_dtype):
    """The AVX-512 and AVX2 units (paged_decode_x86.c; blocks of 8 take the AVX2 one on AVX-512 too)
    against the portable one: every group size (4 query heads per pass and a remainder), partial
    blocks, units of one KV head and of all three, a NaN."""
    lens = [1, 15, 16, 17, 3 * block - 5, 700]
    n = len(lens)
    for group in range(1, 9):
        query, k_cache, v_cache, meta = _case([(c, 1) for c in lens], group, head, block, seed=group, kvh=3)
        k_cache[meta.block_tables[5, 2], 7, 1, 3] = float("nan")  # sequence 5, KV head 1
        k_cache, v_cache = k_cache.to(kv_dtype), v_cache.to(kv_dtype)
        for threads in (1, 16):  # one unit per sequence; then per KV head (ps_decode_chunks)
            outs = []
            for level in isa_levels:
                kernel.lib.ps_set_isa_limit(level)
                out = torch.empty_like(query)
                kernel(out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, torch.arange(n),
                       torch.arange(n), head ** -0.5, num_threads=threads)
                outs.append(out.view(torch.int32))
            assert all(torch.equal(outs[0], o) for o in outs[1:]), f"group {group}, {threads} threads"
        assert outs[0].view(torch.float32)[5, group:2 * group].isnan().all()
        assert not outs[0].view(torch.float32)[5, :group].isnan().any()


def test_mixed_decode_and_prefill_batch_through_forward(kernel):
    shapes = [(9, 1), (13, 13), (17, 5), (1, 1), (40, 1), (33, 7)]
    out, ref = _both(kernel, *_case(shapes, 3, 64, 16), 64)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("q_scale", [0.0, 1e-3, 30.0])
def test_flat_and_peaked_softmax(kernel, q_scale):
    # 0: every weight equal; 30: score gaps of hundreds, so most weights underflow to exactly 0
    query, k_cache, v_cache, meta = _case([(n, 1) for n in (5, 40, 333)], 2, 64, 16, seed=3)
    out, ref = _both(kernel, query * q_scale, k_cache, v_cache, meta, 64)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_strided_query_rows(kernel):
    query, k_cache, v_cache, meta = _case([(30, 1), (5, 1), (64, 1)], 2, 32, 16)
    wide = torch.randn(query.shape[0], query.shape[1] + 5, query.shape[2])
    wide[:, :query.shape[1]] = query
    strided = wide[:, :query.shape[1]]  # row stride larger than heads * head_size, like a slice of qkv
    assert not strided.is_contiguous()
    out, ref = _both(kernel, strided, k_cache, v_cache, meta, 32)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_thread_count_does_not_change_the_result(kernel):
    query, k_cache, v_cache, meta = _case([(n, 1) for n in (3, 70, 200, 16)], 4, 64, 16)
    outs = []
    for threads in (1, 2, 3):
        out = torch.empty_like(query)
        kernel(out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, torch.arange(4),
               torch.arange(4), 0.125, num_threads=threads)
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_nan_in_one_sequence_stays_in_that_sequence(kernel):
    query, k_cache, v_cache, meta = _case([(20, 1), (20, 1)], 2, 32, 8)
    k_cache[meta.block_tables[0, 1], 3, 0, 5] = float("nan")  # sequence 0, KV head 0
    out, ref = _both(kernel, query, k_cache, v_cache, meta, 32)
    assert torch.equal(out.isnan(), ref.isnan())
    assert out[0, :2].isnan().all() and not out[0, 2:].isnan().any() and not out[1].isnan().any()


def test_bad_inputs_raise_instead_of_reading_out_of_bounds(kernel):
    query, k_cache, v_cache, meta = _case([(20, 1)], 2, 32, 8)
    out, rows = torch.empty_like(query), torch.zeros(1, dtype=torch.int64)
    bad_table = meta.block_tables.clone()
    bad_table[0, 1] = k_cache.shape[0]
    with pytest.raises(ValueError, match="block id"):
        kernel(out, query, k_cache, v_cache, bad_table, meta.seq_lens, rows, rows, 0.1)
    with pytest.raises(ValueError, match="longer than its block table"):
        kernel(out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens * 5, rows, rows, 0.1)
    with pytest.raises(ValueError, match="float32"):
        kernel(out, query.double(), k_cache, v_cache, meta.block_tables, meta.seq_lens, rows, rows, 0.1)
    with pytest.raises(ValueError, match="contiguous"):
        kernel(out, query, k_cache.transpose(1, 2), v_cache.transpose(1, 2), meta.block_tables, meta.seq_lens,
               rows, rows, 0.1)
    with pytest.raises(ValueError, match="row index"):
        kernel(out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, rows + 1, rows, 0.1)


def test_bfloat16_caches_with_float32_queries(kernel, monkeypatch):
    """The bf16 KV cache of a bf16 CPU model: read in place by the kernel, widened exactly."""
    query, k_cache, v_cache, meta = _case([(n, 1) for n in (1, 16, 17, 90)], 2, 64, 16)
    k16, v16 = k_cache.bfloat16(), v_cache.bfloat16()
    ref = TorchAttentionBackend().forward(query, k16.float(), v16.float(), meta, 0.125)

    def no_fallback(*_):
        raise AssertionError("decode rows with a bf16 cache fell back to torch")

    monkeypatch.setattr(TorchAttentionBackend, "forward", no_fallback)
    out = FusedCpuAttentionBackend(kernel).forward(query, k16, v16, meta, 0.125)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_non_float32_queries_take_the_torch_path(kernel):
    query, k_cache, v_cache, meta = _case([(20, 1), (9, 4)], 2, 32, 8)
    args = (query.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), meta, 0.2)
    out = FusedCpuAttentionBackend(kernel).forward(*args)
    assert torch.equal(out, TorchAttentionBackend().forward(*args))


def test_compile_cache_reuses_and_keys_by_source(tmp_path, monkeypatch):
    first = cpu_kernels.build_library("portable", tmp_path)
    second = cpu_kernels.build_library("portable", tmp_path)
    assert first.compiled and not second.compiled and second.path == first.path
    changed = tmp_path / "csrc"
    shutil.copytree(cpu_kernels.SOURCE_DIR, changed)
    header = changed / "ps_cpu.h"  # a header counts too: every source includes it
    header.write_text(header.read_text() + "\n/* changed */\n")
    monkeypatch.setattr(cpu_kernels, "SOURCE_DIR", changed)
    third = cpu_kernels.build_library("portable", tmp_path)
    assert third.compiled and third.path != first.path
    assert not first.path.exists()  # the old source's build is pruned, not left to pile up
    assert cpu_kernels.DecodeKernel(third).build is third  # it loads


def test_temp_dir_fallback_must_be_private(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_kernels.tempfile, "gettempdir", lambda: str(tmp_path))
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")  # the preferred cache dir cannot be created under a file
    shared = cpu_kernels._temp_root()
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)  # as if another user had made it, world-writable
    with pytest.raises(OSError, match="no writable cache dir"):
        cpu_kernels._writable_cache_dir(blocker / "cache")
    shared.chmod(0o700)
    assert cpu_kernels._writable_cache_dir(blocker / "cache") == shared / "cpu_kernels"


def test_prebuilt_dir_serves_a_machine_without_a_compiler(tmp_path, monkeypatch, fresh_loader):
    prebuilt = cpu_kernels.build_library("portable", tmp_path / "prebuilt")
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setenv("PAGEDSERVE_PREBUILT_KERNELS", str(tmp_path / "prebuilt"))
    kernel = cpu_kernels.load_decode_kernel()
    assert kernel is not None and kernel.build.path == prebuilt.path and not kernel.build.compiled
    out, ref = _both(kernel, *_case([(n, 1) for n in (1, 17, 300)], 4, 64, 16), 64)  # the portable build
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_missing_compiler_falls_back_to_torch_with_one_warning(tmp_path, monkeypatch, caplog, fresh_loader):
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.delenv("PAGEDSERVE_PREBUILT_KERNELS", raising=False)
    with caplog.at_level(logging.WARNING, logger="executor_svc.cpu_kernels"):
        first = make_attention_backend("cpu")
        second = make_attention_backend("cpu", "auto")
    assert type(first) is TorchAttentionBackend and type(second) is TorchAttentionBackend
    warnings = [r for r in caplog.records if "unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "no-such-cc" in warnings[0].getMessage()
    with pytest.raises(ValueError, match="fused"):
        make_attention_backend("cpu", "fused")


def test_factory_choices(kernel):
    assert isinstance(make_attention_backend("cpu"), FusedCpuAttentionBackend)
    assert isinstance(make_attention_backend("cpu", "fused"), FusedCpuAttentionBackend)
    assert type(make_attention_backend("cpu", "torch")) is TorchAttentionBackend
    with pytest.raises(ValueError, match="cpu_attention"):
        make_attention_backend("cpu", "fast")


def test_cpu_attention_flag_and_environment(tmp_path):
    from executor_svc import config

    base = ["--model", str(tmp_path), "--scheduler", "tcp://h:5556"]
    assert config.parse_config(base, {}).cpu_attention == "auto"
    assert config.parse_config(base, {"PAGEDSERVE_CPU_ATTENTION": "torch"}).cpu_attention == "torch"
    assert config.parse_config([*base, "--cpu-attention", "fused"], {"PAGEDSERVE_CPU_ATTENTION": "torch"}
                               ).cpu_attention == "fused"
    with pytest.raises(SystemExit):
        config.parse_config([*base, "--cpu-attention", "fast"], {})
