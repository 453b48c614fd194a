"""Plain torch references for every kernel, computed in float64 on whatever device the inputs are
on. Written for clarity, not speed: per-sequence gathers and an explicit causal softmax, so they
share no code (and no bug) with the kernels or with the torch attention backend."""

from __future__ import annotations

import torch


def gather_context(cache: torch.Tensor, table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence: ``[length, num_kv_heads, head_size]``."""
    block_size = cache.shape[1]
    t = torch.arange(length, device=cache.device)
    blocks = table.long()[t // block_size]
    return cache[blocks, t % block_size]


def ref_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_tables: torch.Tensor, seq_lens: list[int], query_start_loc: list[int],
                  scale: float) -> torch.Tensor:
    """Causal paged attention in float64: query token i of a sequence with context L and q new
    tokens sits at position L - q + i and sees positions 0..L-q+i. Returns float64
    ``[num_tokens, num_q_heads, head_size]``."""
    num_tokens, num_q_heads, head_size = query.shape
    group = num_q_heads // k_cache.shape[2]
    out = torch.zeros((num_tokens, num_q_heads, head_size), dtype=torch.float64, device=query.device)
    for i, length in enumerate(seq_lens):
        lo, hi = query_start_loc[i], query_start_loc[i + 1]
        if hi == lo:
            continue
        keys = gather_context(k_cache, block_tables[i], length).double().repeat_interleave(group, dim=1)
        values = gather_context(v_cache, block_tables[i], length).double().repeat_interleave(group, dim=1)
        q = query[lo:hi].double()  # [q, heads, head]
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        pos = torch.arange(length - (hi - lo), length, device=query.device)
        visible = torch.arange(length, device=query.device)[None, :] <= pos[:, None]  # [q, L]
        scores = scores.masked_fill(~visible[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # rows with nothing visible -> 0
        out[lo:hi] = torch.einsum("hqk,khd->qhd", probs, values)
    return out


def ref_reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """In place, token by token (negative slot: skip)."""
    block_size = k_cache.shape[1]
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            k_cache[slot // block_size, slot % block_size] = key[t]
            v_cache[slot // block_size, slot % block_size] = value[t]


def ref_copy_blocks(caches: list[tuple[torch.Tensor, torch.Tensor]], pairs: list[tuple[int, int]]) -> None:
    """In place; every source is read before any destination is written."""
    for k, v in caches:
        for cache in (k, v):
            saved = {src: cache[src].clone() for src, _ in pairs}
            for src, dst in pairs:
                cache[dst] = saved[src]


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN anywhere gives inf (never passes a tolerance)."""
    diff = out.double() - ref.double()
    if not bool(torch.isfinite(diff).all()):
        return float("inf")
    return float(diff.norm() / ref.double().norm().clamp_min(1e-300))
