"""A LoRA adapter cut to a tensor-parallel rank's slice of every layer (which slice:
executor_svc/parallel/shard.py).

- Column-parallel projections (q/k/v, gate/up: the rank holds some of their output rows) keep A
  whole and take the rows of B for those outputs: the rank's ``(x A^T) B_r^T`` is exactly its rows
  of the whole delta.
- Row-parallel projections (o, down: the rank holds some of their input columns, and its product is
  a partial sum) take the columns of A for those inputs and keep B whole: ``x A^T`` is the sum over
  ranks of ``x_r A_r^T``, so each rank adds ``(x_r A_r^T) B^T`` to its partial product and the
  all-reduce that sums the base products sums the deltas with them.

The adapter is read and checked whole first (against the whole model), then cut, so every rank
refuses the same files for the same reason.
"""

from __future__ import annotations

import dataclasses

from executor_svc.lora.adapter import LoraAdapter
from executor_svc.model.architecture import ModelConfig
from executor_svc.parallel.shard import TPShard


def rank_slices(shard: TPShard, cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """HF module -> (``"out"``: rows of B, or ``"in"``: columns of A; first; count) this rank holds."""
    hd = cfg.head_dim
    (q0, qn), (kv0, kvn), (i0, i_n) = shard.q_heads(cfg), shard.kv_heads(cfg), shard.intermediate(cfg)
    return {"q_proj": ("out", q0 * hd, qn * hd), "k_proj": ("out", kv0 * hd, kvn * hd),
            "v_proj": ("out", kv0 * hd, kvn * hd), "gate_proj": ("out", i0, i_n), "up_proj": ("out", i0, i_n),
            "o_proj": ("in", q0 * hd, qn * hd), "down_proj": ("in", i0, i_n)}


def shard_adapter(adapter: LoraAdapter, shard: TPShard, cfg: ModelConfig) -> LoraAdapter:
    """``adapter`` (checked against the whole model ``cfg``) as rank ``shard.rank`` holds it."""
    if shard.size == 1:
        return adapter
    slices = rank_slices(shard, cfg)
    weights = {}
    for (layer, module), (a, b) in adapter.weights.items():
        side, first, count = slices[module]
        if side == "out":
            b = b[first:first + count].contiguous()
        else:
            a = a[:, first:first + count].contiguous()
        weights[layer, module] = (a, b)
    return dataclasses.replace(adapter, weights=weights)
