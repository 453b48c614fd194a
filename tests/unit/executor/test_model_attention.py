"""TorchAttentionBackend against dense attention on random inputs (shuffled blocks, mixed batch, GQA)."""

from __future__ import annotations

import math

import pytest
import torch

from executor_svc.attention import AttentionMetadata, TorchAttentionBackend
from executor_svc.backends import make_attention_backend

BS, KVH, QH, D = 4, 2, 6, 8


def _dense(q, k, v, ctx: int) -> torch.Tensor:
    """q [n, QH, D] at positions ctx-n..ctx-1; k, v [ctx, KVH, D]; plain softmax attention."""
    n = q.shape[0]
    k = k.repeat_interleave(QH // KVH, dim=1)
    v = v.repeat_interleave(QH // KVH, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) / math.sqrt(D)
    pos_q = torch.arange(ctx - n, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > pos_q, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).float()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_batch_matches_dense_attention(seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = 40
    k_cache = torch.zeros(num_blocks, BS, KVH, D)
    v_cache = torch.zeros(num_blocks, BS, KVH, D)
    perm = torch.randperm(num_blocks, generator=g).tolist()  # scattered physical blocks
    # (context length, new tokens): decodes, a prefill from scratch, a chunk on a cached prefix
    shapes = [(9, 1), (13, 13), (17, 5), (1, 1), (22, 1)]
    tables, full_k, full_v, slots, queries = [], [], [], [], []
    for ctx, new in shapes:
        table = [perm.pop() for _ in range(-(-ctx // BS))]
        kk, vv = torch.randn(ctx, KVH, D, generator=g), torch.randn(ctx, KVH, D, generator=g)
        for t in range(ctx - new):  # the cached prefix is already in the pool
            k_cache[table[t // BS], t % BS], v_cache[table[t // BS], t % BS] = kk[t], vv[t]
        slots += [table[t // BS] * BS + t % BS for t in range(ctx - new, ctx)]
        tables.append(table)
        full_k.append(kk)
        full_v.append(vv)
        queries.append(torch.randn(new, QH, D, generator=g))
    starts = [0]
    for _, new in shapes:
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor([c for c, _ in shapes], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        max_query_len=max(n for _, n in shapes), max_seq_len=max(c for c, _ in shapes))
    backend = TorchAttentionBackend()
    new_k = torch.cat([k[c - n:] for k, (c, n) in zip(full_k, shapes, strict=True)])
    new_v = torch.cat([v[c - n:] for v, (c, n) in zip(full_v, shapes, strict=True)])
    backend.write_kv(new_k, new_v, k_cache, v_cache, meta)
    out = backend.forward(torch.cat(queries), k_cache, v_cache, meta, 1 / math.sqrt(D))
    for i, (ctx, _) in enumerate(shapes):
        ref = _dense(queries[i], full_k[i], full_v[i], ctx)
        torch.testing.assert_close(out[starts[i]:starts[i + 1]], ref, rtol=1e-5, atol=1e-5)


def test_negative_slots_are_not_written():
    k_cache, v_cache = torch.zeros(2, BS, KVH, D), torch.zeros(2, BS, KVH, D)
    meta = AttentionMetadata(torch.tensor([3, -1, 5]), torch.tensor([0, 3], dtype=torch.int32),
                             torch.tensor([3], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 3, 3)
    kv = torch.ones(3, KVH, D)
    TorchAttentionBackend().write_kv(kv, kv, k_cache, v_cache, meta)
    written = (k_cache.view(-1, KVH, D) != 0).any(-1).any(-1).nonzero().flatten().tolist()
    assert written == [3, 5]


def test_copy_blocks_and_swap_move_whole_blocks():
    b = TorchAttentionBackend()
    dev = [(torch.randn(4, BS, KVH, D), torch.randn(4, BS, KVH, D)) for _ in range(2)]
    cpu = [(torch.zeros(3, BS, KVH, D), torch.zeros(3, BS, KVH, D)) for _ in range(2)]
    before = [(k.clone(), v.clone()) for k, v in dev]
    b.copy_blocks(dev, [(0, 1), (1, 2)])  # all reads happen before writes
    for (k, v), (k0, v0) in zip(dev, before, strict=True):
        assert torch.equal(k[1], k0[0]) and torch.equal(k[2], k0[1]) and torch.equal(v[2], v0[1])
    b.swap(dev, cpu, [(3, 2)])
    b.swap(cpu, dev, [(2, 0)])
    for (k, v), (k0, v0) in zip(dev, before, strict=True):
        assert torch.equal(k[0], k0[3]) and torch.equal(v[0], v0[3])


def test_factory():
    # CPU: the fused decode kernel where it builds (tests/unit/executor/test_cpu_decode_kernel.py), torch otherwise;
    # both run the torch reference for prefill rows.
    cpu = make_attention_backend("cpu")
    assert isinstance(cpu, TorchAttentionBackend) and cpu.name in ("cpu-fused", "torch")
    assert type(make_attention_backend("cpu", "torch")) is TorchAttentionBackend
    with pytest.raises(ValueError, match="device"):
        make_attention_backend("tpu")
