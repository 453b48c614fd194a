"""Random paged-attention problems for tests and benchmarks.

A case has sequences with context lengths ``ctx_lens`` whose last ``q_lens`` tokens are new this
step. Block tables are shuffled (no sequence owns consecutive blocks), the caches start poisoned
with NaN so that reading any slot nobody wrote shows up in the output, the cached prefix is
written by the reference and the new tokens are left for the kernel under test.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from testing.kernels.reference import ref_reshape_and_cache


@dataclass(slots=True)
class PagedCase:
    query: torch.Tensor  # [num_tokens, num_q_heads, head_size]
    key: torch.Tensor  # [num_tokens, num_kv_heads, head_size] new tokens' keys
    value: torch.Tensor  # [num_tokens, num_kv_heads, head_size]
    k_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_size]
    v_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    slot_mapping: torch.Tensor  # [num_tokens] int64
    ctx_lens: list[int]
    q_lens: list[int]

    @property
    def starts(self) -> list[int]:
        return self.query_start_loc.tolist()


def make_case(ctx_lens: list[int], q_lens: list[int], num_q_heads: int, num_kv_heads: int,
              head_size: int, block_size: int, dtype: torch.dtype, device: str | torch.device,
              seed: int, extra_blocks: int = 3, poison: bool = True) -> PagedCase:
    """Build a case; the prefix (all but the last q_lens tokens) is already in the cache."""
    if len(ctx_lens) != len(q_lens) or any(q > c for q, c in zip(q_lens, ctx_lens, strict=True)):
        raise ValueError(f"q_lens {q_lens} must pair with ctx_lens {ctx_lens} and not exceed them")
    gen = torch.Generator().manual_seed(seed)
    nb_per_seq = [math.ceil(c / block_size) for c in ctx_lens]
    num_blocks = sum(nb_per_seq) + extra_blocks
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max([1, *nb_per_seq])
    tables = torch.zeros((len(ctx_lens), max_blocks), dtype=torch.int32)
    used = 0
    for i, nb in enumerate(nb_per_seq):
        tables[i, :nb] = torch.tensor(perm[used:used + nb], dtype=torch.int32)
        used += nb
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    fill = float("nan") if poison else 0.0
    k_cache = torch.full(shape, fill, dtype=dtype)
    v_cache = torch.full(shape, fill, dtype=dtype)
    total_q = sum(q_lens)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen).to(dtype)

    query = rnd(total_q, num_q_heads, head_size)
    slots_new: list[int] = []
    for i, (c, q) in enumerate(zip(ctx_lens, q_lens, strict=True)):
        prefix = [_slot(tables[i], t, block_size) for t in range(c - q)]
        if prefix:
            n = len(prefix)
            ref_reshape_and_cache(rnd(n, num_kv_heads, head_size), rnd(n, num_kv_heads, head_size),
                                  k_cache, v_cache, torch.tensor(prefix))
        slots_new += [_slot(tables[i], t, block_size) for t in range(c - q, c)]
    starts = [0]
    for q in q_lens:
        starts.append(starts[-1] + q)
    dev = torch.device(device)
    return PagedCase(
        query=query.to(dev), key=rnd(total_q, num_kv_heads, head_size).to(dev),
        value=rnd(total_q, num_kv_heads, head_size).to(dev), k_cache=k_cache.to(dev), v_cache=v_cache.to(dev),
        block_tables=tables.to(dev), seq_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=dev),
        slot_mapping=torch.tensor(slots_new, dtype=torch.int64, device=dev),
        ctx_lens=list(ctx_lens), q_lens=list(q_lens))


def _slot(table: torch.Tensor, t: int, block_size: int) -> int:
    return int(table[t // block_size]) * block_size + t % block_size
