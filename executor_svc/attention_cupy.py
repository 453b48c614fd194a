"""The CUDA attention backend: pagedserve's own PagedAttention kernels through CuPy.

Same interface and semantics as the torch reference backend (executor_svc/attention.py); the
kernels live in cupy_kernels/. Everything runs on torch's current stream over torch's tensors in
place, so the runner needs no synchronisation around attention.

Dispatch per step: when every sequence has exactly one new token (``max_query_len == 1``) the
decode kernel runs (single pass or split context, see cupy_kernels/launchers.py); otherwise the
prefill kernel handles the whole packed batch, decode rows included, reading each sequence's
cached prefix straight from the block pool (chunked prefill and prefix-cache hits need no gather).
"""

from __future__ import annotations

import torch

from cupy_kernels import cache_ops, launchers
from executor_svc.attention import AttentionBackend, AttentionMetadata, KVCaches


class CupyAttentionBackend(AttentionBackend):
    name = "cupy"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        if key.dtype != k_cache.dtype:
            key, value = key.to(k_cache.dtype), value.to(k_cache.dtype)
        cache_ops.reshape_and_cache(key, value, k_cache, v_cache, meta.slot_mapping)

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if query.dtype != k_cache.dtype:
            raise ValueError(f"query: dtype {query.dtype} differs from the KV cache's {k_cache.dtype}")
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
