"""The CUDA attention backend: pagedserve's own PagedAttention kernels through CuPy.

Same interface and semantics as the torch reference backend (executor_svc/attention.py); the
kernels live in cupy_kernels/. Everything runs on torch's current stream over torch's tensors in
place, so the runner needs no synchronisation around attention.

Dispatch per step: when every sequence has exactly one new token (``max_query_len == 1``) the
decode kernel runs (single pass or split context, see cupy_kernels/launchers.py); otherwise the
prefill kernel handles the whole packed batch, decode rows included, reading each sequence's
cached prefix straight from the block pool (chunked prefill and prefix-cache hits need no gather).

Batch-invariant (``batch_invariant=True``): every query row, prefill or decode, is a decode query
of its own over its sequence's table cut at its position, through the decode kernel at a fixed
split size (``launchers.INVARIANT_PARTITION``). A row then reduces over its keys in one order set
by its position alone: not by the batch's longest context (the split rule), not by whether it
arrived in a prefill chunk, a decode step or a recompute (the two kernels order their sums
differently), as the CPU backend does (attention_cpu.py). Prefill attention then reads the cache
once per row instead of once per 16 rows. The CUDA executor does not claim the mode yet: its
linear layers and norms are cuBLAS and torch reductions shaped by the step (batch_invariance.py).
"""

from __future__ import annotations

import torch

from cupy_kernels import cache_ops, launchers
from executor_svc.attention import AttentionBackend, AttentionMetadata, KVCaches


class CupyAttentionBackend(AttentionBackend):
    name = "cupy"
    fused_kv_write = True  # write_kv is reshape_and_cache into the contract's layout, nothing more

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        if key.dtype != k_cache.dtype:
            key, value = key.to(k_cache.dtype), value.to(k_cache.dtype)
        cache_ops.reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if query.dtype != k_cache.dtype:
            raise ValueError(f"query: dtype {query.dtype} differs from the KV cache's {k_cache.dtype}")
        if self.batch_invariant:
            tables, lens = _row_queries(query, meta)
            return launchers.paged_attention_decode(query, k_cache, v_cache, tables, lens, meta.max_seq_len, scale,
                                                    partition_size=launchers.INVARIANT_PARTITION)
        if meta.max_query_len == 1 and query.shape[0] == meta.num_seqs:
            return launchers.paged_attention_decode(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                                    meta.max_seq_len, scale)
        return launchers.paged_attention_prefill(query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                                 meta.query_start_loc, meta.max_query_len, meta.max_seq_len,
                                                 scale)

    def copy_blocks(self, caches: KVCaches, pairs: list[tuple[int, int]]) -> None:
        if not pairs:
            return
        srcs, dsts = {s for s, _ in pairs}, [d for _, d in pairs]
        if srcs.isdisjoint(dsts) and len(set(dsts)) == len(dsts):
            cache_ops.copy_blocks(caches, pairs)  # one launch for every layer
        else:  # chained copies: the gather-then-scatter reference keeps "all reads first"
            super().copy_blocks(caches, pairs)

    def swap(self, src_caches: KVCaches, dst_caches: KVCaches, pairs: list[tuple[int, int]]) -> None:
        if pairs:
            cache_ops.swap_blocks(src_caches, dst_caches, pairs)


def _row_queries(query: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """(block tables, context lengths) with one row per query row: row ``j`` of a sequence with
    context ``L`` and ``q`` new tokens sees that sequence's table and its first ``L - q + j + 1``
    keys. A pure decode step's own tables; on the device, no host sync."""
    n = query.shape[0]
    if meta.max_query_len == 1 and n == meta.num_seqs:
        return meta.block_tables, meta.seq_lens
    starts = meta.query_start_loc.to(torch.int64)
    owner = torch.repeat_interleave(torch.arange(meta.num_seqs, device=query.device), starts[1:] - starts[:-1],
                                    output_size=n)  # each row's sequence
    rows = torch.arange(n, device=query.device)
    lens = meta.seq_lens.to(torch.int64)[owner] - (starts[1:][owner] - 1 - rows)
    return meta.block_tables.index_select(0, owner).contiguous(), lens.to(torch.int32)
