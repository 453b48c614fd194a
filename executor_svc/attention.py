"""Attention over the paged KV cache: the backend interface and the torch reference.

The contract (docs/ARCHITECTURE.md, "Attention backend interface"): per layer,
``k_cache``/``v_cache`` are ``[num_blocks, block_size, num_kv_heads, head_size]``
and token ``t`` of a sequence lives in slot
``block_table[t // block_size] * block_size + t % block_size``. A step packs
every scheduled sequence's new tokens back to back (no padding); query token
``i`` of a sequence with context ``L`` and ``q`` new tokens sits at position
``L - q + i`` and attends causally to positions ``0 .. L - q + i``. Decode
(``q == 1``) and chunked prefill on top of cached blocks are the same thing.

The torch backend is the reference the CUDA kernels are checked against: it
gathers each sequence's blocks and runs ``scaled_dot_product_attention`` with
an explicit mask. Decode-only sequences are batched together (one gather, one
SDPA call); sequences with several new tokens go one by one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)


@dataclass(slots=True)
class AttentionMetadata:
    """One step's batch layout, shared by all layers (built by the runner)."""

    slot_mapping: torch.Tensor  # [num_tokens] int64, cache slot per new token (negative: do not write)
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative new-token counts
    seq_lens: torch.Tensor  # [num_seqs] int32, context length including this step's tokens
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with 0
    max_query_len: int
    max_seq_len: int
    # Host mirrors of query_start_loc / seq_lens, so a backend need not sync to read them.
    query_start_loc_host: list[int] | None = None  # [num_seqs + 1]
    seq_lens_host: list[int] | None = None  # [num_seqs]

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])


class AttentionBackend(ABC):
    """What the model needs from an attention implementation."""

    name: str = "abstract"  # for logs and reports only: what a backend can do is in its attributes
    # Pure decode steps may run the model's fused decode stack (executor_svc/model/cpu_decode.py),
    # which computes this backend's attention inside the same C call.
    runs_decode_stack: bool = False
    # The model may write a step's K/V into this backend's caches itself, instead of calling write_kv
    # (the fused RoPE + cache-write kernel, executor_svc/model/cuda_layers.py): the caches are the
    # contract's layout, slots the metadata's, and write_kv does nothing more than store them.
    fused_kv_write: bool = False

    @abstractmethod
    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """Store key/value ``[num_tokens, num_kv_heads, head_size]`` at ``meta.slot_mapping``."""

    @abstractmethod
    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """query ``[num_tokens, num_q_heads, head_size]`` -> output of the same shape."""

    def copy_blocks(self, caches: KVCaches, pairs: list[tuple[int, int]]) -> None:
        """``block[dst] = block[src]`` in every layer, all reads before all writes."""
        if not pairs:
            return
        device = caches[0][0].device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=device)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=device)
        for k_cache, v_cache in caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    def swap(self, src_caches: KVCaches, dst_caches: KVCaches, pairs: list[tuple[int, int]]) -> None:
        """``dst_pool[dst] = src_pool[src]`` for (src, dst) pairs, across devices."""
        if not pairs:
            return
        src_dev, dst_dev = src_caches[0][0].device, dst_caches[0][0].device
        src = torch.tensor([p[0] for p in pairs], dtype=torch.int64, device=src_dev)
        dst = torch.tensor([p[1] for p in pairs], dtype=torch.int64, device=dst_dev)
        for (sk, sv), (dk, dv) in zip(src_caches, dst_caches, strict=True):
            dk[dst] = sk[src].to(dst_dev)
            dv[dst] = sv[src].to(dst_dev)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        slots = meta.slot_mapping
        keep = slots >= 0
        if not bool(keep.all()):
            slots, key, value = slots[keep], key[keep], value[keep]
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        starts = meta.query_start_loc_host or meta.query_start_loc.tolist()
        lens = meta.seq_lens_host or meta.seq_lens.tolist()
        out = torch.empty_like(query)
        q_lens = [starts[i + 1] - starts[i] for i in range(len(lens))]
        decode = [i for i, q in enumerate(q_lens) if q == 1]
        if decode:
            self._decode_batch(query, k_cache, v_cache, meta, scale, decode, starts, lens, out)
        for i, q in enumerate(q_lens):
            if q > 1:
                rows = slice(starts[i], starts[i + 1])
                out[rows] = self._one_sequence(query[rows], k_cache, v_cache, meta.block_tables[i],
                                               lens[i], scale)
        return out

    @staticmethod
    def _gather(cache: torch.Tensor, tables: torch.Tensor, length: int) -> torch.Tensor:
        """tables [n, nb] -> [n, num_kv_heads, length, head_size] (first ``length`` slots)."""
        block_size = cache.shape[1]
        nb = -(-length // block_size)
        n = tables.shape[0]
        # index_select is ~10x faster than advanced indexing here on CPU
        kv = cache.index_select(0, tables[:, :nb].reshape(-1).long())  # [n * nb, block_size, kv_heads, head]
        kv = kv.view(n, nb * block_size, *cache.shape[2:])[:, :length]
        return kv.transpose(1, 2)

    def _decode_batch(self, query, k_cache, v_cache, meta, scale, idx, starts, lens, out) -> None:
        rows = torch.tensor([starts[i] for i in idx], dtype=torch.int64, device=query.device)
        sel = torch.tensor(idx, dtype=torch.int64, device=query.device)
        max_len = max(lens[i] for i in idx)
        tables = meta.block_tables.index_select(0, sel)
        keys = self._gather(k_cache, tables, max_len).to(query.dtype)
        values = self._gather(v_cache, tables, max_len).to(query.dtype)
        seq_lens = torch.tensor([lens[i] for i in idx], device=query.device)
        positions = torch.arange(max_len, device=query.device)
        mask = (positions[None, :] < seq_lens[:, None])[:, None, None, :]  # [n, 1, 1, max_len]
        q = query.index_select(0, rows)[:, :, None, :]  # [n, q_heads, 1, head]
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        out.index_copy_(0, rows, o[:, :, 0, :])

    def _one_sequence(self, query, k_cache, v_cache, table, seq_len, scale) -> torch.Tensor:
        q_len = query.shape[0]
        keys = self._gather(k_cache, table[None], seq_len).to(query.dtype)
        values = self._gather(v_cache, table[None], seq_len).to(query.dtype)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, seq_len] causal with the cached prefix
        q = query.transpose(0, 1)[None]  # [1, q_heads, q_len, head]
        o = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
        return o[0].transpose(0, 1)
