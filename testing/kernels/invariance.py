"""A request alone against the same request in a batch, through an attention backend, bit for bit.

The case the GPU tests (``make gpu-check``) run on the CUDA kernels and the suite runs on the same
sources through the SIMT emulator (testing/kernels/emulate.py). A request R has a context longer
than the batch-invariant split size, so it is split, and a chunk of new tokens. Its output rows
must be the same bits:

- alone (only R in the step);
- in a batch: beside a longer decode row (more partitions in the launch), a fresh prefill, short
  decode rows, one of them a single token;
- in two chunks of other sizes (chunked prefill, a prefix-cache hit on the first part);
- one row at a time as decode steps (a recompute against the steps that first computed them).

Every key and value is written before attention runs (the backends' contract: ``write_kv`` comes
first), so this checks the attention kernels' order of sums alone.
"""

from __future__ import annotations

import torch

from executor_svc.attention import AttentionBackend, AttentionMetadata
from testing.kernels.cases import PagedCase, make_case
from testing.kernels.reference import ref_reshape_and_cache

SCALE = 0.125
R = 1  # the request's index in the batch
# Context lengths (this step's tokens included) and new tokens this step: R's context spans two
# 256-token partitions (launchers.INVARIANT_PARTITION), its first neighbour's three. SMALL is the
# same shape for a 64-token split (the emulator, which runs every CUDA thread as a CPU thread).
LAYOUT = ([700, 300, 5, 17, 1], [1, 20, 5, 1, 1])
SMALL = ([180, 100, 5, 17, 1], [1, 6, 5, 1, 1])


def batch_case(num_q_heads: int, num_kv_heads: int, head_size: int, block_size: int, dtype: torch.dtype,
               device: str | torch.device, seed: int, layout=LAYOUT) -> PagedCase:
    """The batch, every token's K/V in the cache (the new ones too)."""
    case = make_case(*layout, num_q_heads, num_kv_heads, head_size, block_size, dtype, "cpu", seed=seed)
    ref_reshape_and_cache(case.key, case.value, case.k_cache, case.v_cache, case.slot_mapping)
    for name in ("query", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc", "slot_mapping"):
        setattr(case, name, getattr(case, name).to(device))
    return case


def _step(case: PagedCase, parts: list[tuple[int, int, int]]) -> tuple[torch.Tensor, AttentionMetadata]:
    """The query rows and metadata of a step of ``parts``: (sequence, its context this step, its new
    tokens), each ending at that context (a chunk cut from the case's rows)."""
    dev = case.query.device
    rows, starts, lens = [], [0], []
    case_starts = case.starts
    for seq, ctx, q in parts:
        last = case_starts[seq] + case.q_lens[seq] - (case.ctx_lens[seq] - ctx)  # one past the row of position ctx - 1
        rows += list(range(last - q, last))
        starts.append(starts[-1] + q)
        lens.append(ctx)
    tables = case.block_tables[[seq for seq, _, _ in parts]]
    meta = AttentionMetadata(torch.full((len(rows),), -1, dtype=torch.int64, device=dev),
                             torch.tensor(starts, dtype=torch.int32, device=dev),
                             torch.tensor(lens, dtype=torch.int32, device=dev), tables.contiguous(),
                             max(q for _, _, q in parts), max(lens), starts, lens)
    return case.query[torch.tensor(rows, device=dev)].contiguous(), meta


def _run(backend: AttentionBackend, case: PagedCase, parts: list[tuple[int, int, int]]) -> torch.Tensor:
    query, meta = _step(case, parts)
    return backend.forward(query, case.k_cache, case.v_cache, meta, SCALE)


def request_alone_and_in_a_batch(backend: AttentionBackend, case: PagedCase) -> dict[str, torch.Tensor]:
    """R's output rows computed each way (see the module doc), by name; the test compares them."""
    ctx, q = case.ctx_lens[R], case.q_lens[R]
    everyone = [(i, c, n) for i, (c, n) in enumerate(zip(case.ctx_lens, case.q_lens, strict=True))]
    batch = _run(backend, case, everyone)
    first = case.starts[R]
    split = max(1, q // 3)
    return {
        "alone": _run(backend, case, [(R, ctx, q)]),
        "in a batch": batch[first:first + q],
        "in two chunks": torch.cat([_run(backend, case, [(R, ctx - q + split, split)]),
                                    _run(backend, case, [(4, 1, 1), (R, ctx, q - split), everyone[0]])[1:1 + q - split]]),
        "as decode steps": torch.cat([_run(backend, case, [(R, ctx - q + j + 1, 1)]) for j in range(q)]),
    }


def differences(outputs: dict[str, torch.Tensor]) -> list[str]:
    """Each way that is not bit-identical to R alone (empty: all are)."""
    alone = outputs["alone"]
    found = []
    for name, out in outputs.items():
        if not torch.equal(out, alone):
            diff = (out.float() - alone.float()).abs().max()
            found.append(f"{name}: differs from alone by up to {float(diff):.3g}")
    return found
