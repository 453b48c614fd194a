"""The target's sampling distribution at each verified position, as the plain sampler would form it.

Row i of a verify forward scores the token after the proposals 0..i-1, so the history its
penalties and ``min_tokens`` see includes those proposals: each row gets a view of the sequence
with them appended. Then the sampler's own steps in its order (penalties, logit bias,
``min_tokens``, temperature, top-k / top-p / min-p), so rejection sampling keeps every knob's
meaning. Grammar masks are not applied: structured-output requests do not speculate (yet).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from executor_svc.batch import SeqState
from executor_svc.sampler import apply_logit_bias, apply_min_tokens, apply_penalties, truncate_sorted
from executor_svc.speculative.rejection import seeded_uniforms, verify_point_mass


def target_probs(seq: SeqState, proposals: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
    """logits [k + 1, vocab] of a sampled (temperature > 0) sequence -> probabilities [k + 1, vocab]."""
    rows = list(range(len(proposals) + 1))
    views = [dataclasses.replace(seq, token_ids=seq.token_ids + list(proposals[:i])) for i in rows]
    work = logits.to(torch.float32).clone()
    apply_penalties(work, views)
    apply_logit_bias(work, views, rows)
    apply_min_tokens(work, views, rows)
    p = seq.sampling
    work /= p.temperature
    if p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0.0:
        ordered, order = torch.sort(work, dim=-1, descending=True, stable=True)
        work = torch.empty_like(work).scatter_(1, order, truncate_sorted(ordered, [p] * len(rows)))
    return torch.softmax(work, dim=-1)


def accept_sampled(seq: SeqState, proposals: Sequence[int], logits: torch.Tensor,
                   uniforms: tuple[list[float], list[float]] | None = None) -> list[int]:
    """Rejection sampling applied to the sequence's state (as ``accept_greedy``). A seeded request
    draws its uniforms from (seed, output position); others pass ``uniforms`` from their generator."""
    if uniforms is None:
        if seq.sampling.seed is None:
            raise ValueError(f"seq {seq.seq_id}: an unseeded request needs uniforms from the caller")
        uniforms = seeded_uniforms(seq.sampling.seed, len(seq.token_ids) - seq.num_prompt_tokens,
                                   len(proposals) + 1)
    emitted = verify_point_mass(proposals, target_probs(seq, proposals, logits), *uniforms)
    seq.num_computed_tokens = len(seq.token_ids) + len(emitted) - 1
    seq.token_ids.extend(emitted)
    return emitted
