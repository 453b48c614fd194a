"""CPU attention with the fused paged decode kernel (executor_svc/csrc/paged_decode_cpu.c).

Decode rows (one new token per sequence) go to the C kernel, which reads each
sequence's K/V blocks in place through its block table instead of gathering
them into a padded tensor for SDPA: on the serve_vs_hf shapes that is the
difference between reading the cache once and copying it twice
(docs/PERF.md). Rows with several new tokens (prefill, chunked prefill) keep
the torch reference path, as do queries not in float32 (the kernel computes in
float32 and reads a float32 or bfloat16 cache; other dtypes fall back per call).
"""

from __future__ import annotations

import torch

from executor_svc.attention import AttentionMetadata, TorchAttentionBackend
from executor_svc.cpu_kernels import KV_TYPES, DecodeKernel


class FusedCpuAttentionBackend(TorchAttentionBackend):
    name = "cpu-fused"
    runs_decode_stack = True  # (the decode stack's attention is this kernel's, csrc/decode_stack_cpu.c)

    def __init__(self, kernel: DecodeKernel) -> None:
        self.kernel = kernel
        # Per-step index tensors, built once and reused by every layer (same metadata object).
        self._step: tuple | None = None

    def forward(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if query.dtype != torch.float32 or k_cache.dtype not in KV_TYPES or query.device.type != "cpu":
            return super().forward(query, k_cache, v_cache, meta, scale)
        starts = meta.query_start_loc_host or meta.query_start_loc.tolist()
        lens = meta.seq_lens_host or meta.seq_lens.tolist()
        prefill, rows, seqs, tables, seq_lens = self._decode_rows(meta, starts)
        if query.shape[0] != starts[-1] or len(lens) != len(starts) - 1:
            raise ValueError(f"attention: {query.shape[0]} query rows and {len(lens)} sequences for a "
                             f"layout of {starts[-1]} rows and {len(starts) - 1} sequences")
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype)
        if rows.numel():
            # rows/seqs come from query_start_loc, just checked against query and seq_lens
            self.kernel(out, query, k_cache, v_cache, tables, seq_lens, rows, seqs, scale, check_indices=False)
        for i in prefill:
            r = slice(starts[i], starts[i + 1])
            out[r] = self._one_sequence(query[r], k_cache, v_cache, meta.block_tables[i], lens[i], scale)
        return out

    def _decode_rows(self, meta: AttentionMetadata, starts: list[int]):
        """(prefill sequence indices, decode rows, their sequence indices, int32 tables, int32 lengths)."""
        if self._step is not None and self._step[0] is meta:
            return self._step[1:]
        decode = [i for i in range(len(starts) - 1) if starts[i + 1] - starts[i] == 1]
        prefill = [i for i in range(len(starts) - 1) if starts[i + 1] - starts[i] > 1]
        rows = torch.tensor([starts[i] for i in decode], dtype=torch.int64)
        seqs = torch.tensor(decode, dtype=torch.int64)
        tables = meta.block_tables
        if tables.dtype != torch.int32 or tables.stride(-1) != 1:
            tables = tables.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()  # a no-op for the runner's metadata
        self._step = (meta, prefill, rows, seqs, tables, seq_lens)
        return prefill, rows, seqs, tables, seq_lens
