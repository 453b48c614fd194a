"""CPU attention with the fused paged decode kernel (executor_svc/csrc/paged_decode_cpu.c).

Every query row goes to the C kernel, which reads its sequence's K/V blocks in place through
the block table instead of gathering them into a padded tensor for SDPA: on the serve_vs_hf
shapes that is the difference between reading the cache once and copying it twice
(docs/PERF.md). A row of a prefill (several new tokens of one sequence) is a decode query of
its own: the sequence's table, cut at the row's position (its K/V, and those of the rows
before it, are written before attention runs). So each query reduces over its keys in one
order, block by block, whether they were cached by an earlier step or written by this one,
and however the prefill was chunked: SDPA blocks its sums by the query count ("What a seed
guarantees", docs/ARCHITECTURE.md). Queries not in float32 keep the torch reference path
(the kernel computes in float32 and reads a float32 or bfloat16 cache).
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
        if query.shape[0] != starts[-1] or len(lens) != len(starts) - 1:
            raise ValueError(f"attention: {query.shape[0]} query rows and {len(lens)} sequences for a "
                             f"layout of {starts[-1]} rows and {len(starts) - 1} sequences")
        rows, seqs, tables, seq_lens = self._query_rows(meta, starts, lens)
        if query.stride(-1) != 1:
            query = query.contiguous()
        out = torch.empty(query.shape, dtype=query.dtype)
        if rows.numel():
            # rows/seqs come from query_start_loc, just checked against query and seq_lens
            self.kernel(out, query, k_cache, v_cache, tables, seq_lens, rows, seqs, scale, check_indices=False)
        return out

    def _query_rows(self, meta: AttentionMetadata, starts: list[int], lens: list[int]):
        """(query rows, their indices into the tables and lengths, int32 tables, int32 lengths).

        A pure decode step uses the step's tables as they are. Any other gets one table row and
        one length per query row: row ``j`` of a sequence with context ``L`` and ``q`` new tokens
        sees the first ``L - q + j + 1`` keys."""
        if self._step is not None and self._step[0] is meta:
            return self._step[1:]
        tables = meta.block_tables
        if tables.dtype != torch.int32 or tables.stride(-1) != 1:
            tables = tables.to(torch.int32).contiguous()
        n_seqs = len(starts) - 1
        if meta.max_query_len <= 1 and all(starts[i + 1] - starts[i] <= 1 for i in range(n_seqs)):
            decode = [i for i in range(n_seqs) if starts[i + 1] - starts[i] == 1]
            rows = torch.tensor([starts[i] for i in decode], dtype=torch.int64)
            seqs = torch.tensor(decode, dtype=torch.int64)
            seq_lens = meta.seq_lens.to(torch.int32).contiguous()  # a no-op for the runner's metadata
        else:
            tables, seq_lens = per_row_tables(tables, starts, lens)
            rows = seqs = torch.arange(starts[-1], dtype=torch.int64)
        self._step = (meta, rows, seqs, tables, seq_lens)
        return rows, seqs, tables, seq_lens


def per_row_tables(tables: torch.Tensor, starts: list[int], lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """One block-table row and one context length per query row (int32 [rows, width], [rows]):
    row ``j`` of a sequence with context ``L`` and ``q`` new tokens sees the first ``L - q + j + 1``
    keys. ``tables`` [num_seqs, width] int32, ``starts`` the query start of each sequence and the end."""
    n_seqs = len(starts) - 1
    q_lens = torch.tensor([starts[i + 1] - starts[i] for i in range(n_seqs)], dtype=torch.int64)
    owner = torch.repeat_interleave(torch.arange(n_seqs), q_lens)  # each row's sequence
    ends = torch.tensor(starts[1:], dtype=torch.int64)[owner]  # one past its sequence's last row
    rows = torch.arange(starts[-1], dtype=torch.int64)
    seq_lens = (torch.tensor(lens, dtype=torch.int64)[owner] - (ends - 1 - rows)).to(torch.int32)
    return tables.index_select(0, owner).contiguous(), seq_lens
