"""One step of beam search, with Hugging Face transformers' semantics.

Mirrors ``GenerationMixin._beam_search`` (transformers 5.x) for one request:

* every live beam reports its top ``2 * width`` next tokens (log-softmax of
  the raw logits); candidates are ranked across beams by cumulative log-prob
  and the best ``2 * width`` kept;
* a kept candidate that hits a stopping condition (EOS, a stop token id, or
  the length limit) becomes a finished hypothesis only if it ranks in the
  first ``width``; its score is ``cum_logprob / generated_len ** length_penalty``
  (generated_len counts the new token); the best ``width`` hypotheses are kept;
* the best ``width`` non-stopping candidates are the next step's beams;
* ``early_stopping=False``: once ``width`` hypotheses exist, stop when the
  best running beam's ``cum_logprob / generated_len ** length_penalty`` is no
  longer better than the worst hypothesis (HF's heuristic); ``True``: stop as
  soon as ``width`` hypotheses exist. Also stop when every candidate stopped.

This module is pure: the scheduler turns the chosen (parent, token) pairs
into forks, appended tokens and freed beams.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pagedserve.engine_api import FinishReason
from scheduler_svc.sched.request import BeamHypothesis, BeamState, Sequence


@dataclass(slots=True)
class BeamCandidate:
    score: float  # parent's cumulative log-prob + this token's log-prob
    parent: Sequence
    token_id: int


@dataclass(slots=True)
class BeamLimits:
    """Request-level knobs of a beam search."""

    eos_token_ids: frozenset[int]  # empty when the request ignores EOS
    stop_token_ids: frozenset[int]
    length_penalty: float
    early_stopping: bool


def length_norm(length: int, length_penalty: float) -> float:
    """``length ** length_penalty``, saturating at inf (the API edge bounds the penalty; a score
    must never raise, whatever reaches here)."""
    try:
        return float(length) ** length_penalty
    except OverflowError:
        return math.inf


def stop_reason(token_id: int, length_reached: bool, lim: BeamLimits) -> FinishReason | None:
    if token_id in lim.eos_token_ids:
        return FinishReason.EOS
    if token_id in lim.stop_token_ids:
        return FinishReason.STOP
    return FinishReason.LENGTH if length_reached else None


def beam_step(state: BeamState, beams: list[Sequence], cands: dict[int, tuple[list[int], list[float]]],
              length_reached: bool, lim: BeamLimits) -> tuple[list[BeamCandidate], bool]:
    """Advance one request's beam search by one token.

    ``cands[seq_id]`` = (token ids, log-probs) reported for each live beam;
    ``length_reached`` says the new token reaches max_tokens/max_model_len.
    Returns the next beams (best first, at most ``width``) and whether the
    search is done (then ``state.finished`` holds the answer).
    """
    width = state.width
    ranked: list[BeamCandidate] = []
    for seq in beams:
        toks, lps = cands.get(seq.seq_id, ((), ()))
        for tok, lp in zip(toks, lps, strict=True):
            ranked.append(BeamCandidate(seq.cum_logprob + lp, seq, tok))
    ranked.sort(key=lambda c: c.score, reverse=True)  # stable: ties keep beam order
    top = ranked[: 2 * width]
    if not top:
        return [], True
    gen_len = beams[0].num_output_tokens + 1  # all beams have the same length
    norm = length_norm(gen_len, lim.length_penalty)
    reasons = [stop_reason(c.token_id, length_reached, lim) for c in top]
    full = len(state.finished) >= width
    if state.improvable and not (lim.early_stopping and full):
        for c, why in zip(top[:width], reasons[:width], strict=True):
            if why is not None:
                state.finished.append(BeamHypothesis(
                    c.score / norm, c.parent.output_token_ids + [c.token_id], why))
        state.finished.sort(key=lambda h: h.score, reverse=True)
        del state.finished[width:]
    running = [c for c, why in zip(top, reasons, strict=True) if why is None][:width]
    if running and len(state.finished) >= width:
        best_possible = running[0].score / norm
        if not best_possible > state.finished[-1].score:
            state.improvable = False
    done = (not running or not state.improvable
            or (lim.early_stopping and len(state.finished) >= width))
    return running, done


def final_hypotheses(state: BeamState, beams: list[Sequence], lim: BeamLimits) -> list[BeamHypothesis]:
    """The answer, best first; falls back to live beams if too few finished (defensive)."""
    out = list(state.finished)
    if len(out) < state.width:
        for seq in sorted(beams, key=lambda s: s.cum_logprob, reverse=True):
            norm = length_norm(max(seq.num_output_tokens, 1), lim.length_penalty)
            out.append(BeamHypothesis(seq.cum_logprob / norm, seq.output_token_ids, FinishReason.LENGTH))
        out.sort(key=lambda h: h.score, reverse=True)
    return out[: state.width]
