"""When to propose: per sequence by its recent acceptance, per step by the batch's size.

A proposal costs k more positions in the verify forward. At batch 1 that forward is bound by
reading the weights, so extra positions are nearly free; a sequence whose proposals are rarely
accepted still pays them in attention and logits, and in a large batch the step is bound by
compute, where every position costs its share. So:

* per sequence: an exponential average of the accepted fraction of its proposals; below
  ``min_acceptance`` it stops proposing for a back-off of steps that doubles each time it fails
  again (up to ``max_backoff``), then probes with one proposal round. Text that starts repeating
  later (an edit after a preamble) is found again by the probes.
* per step: at most ``max_verified_tokens`` positions are verified (one per decoding sequence,
  plus the proposals). Sequences propose in scheduling order while the budget has room, so a
  batch of that many sequences or more does not speculate at all. On a CPU a verification runs in
  the fused decode step (each proposal a row of its own), where a step's cost grows with its rows
  once the weights' read is shared by enough of them: on SmolLM2 (Q4_1, 2 threads) 20 rows cost
  ~1.9x a step of 4, 80 rows ~2.7x a step of 16. The default, 32, lets 1-6 streams propose at k = 4
  and a batch of 16 spend 16 more positions on its first proposing sequences
  (benchmarks/speculative.py; docs/PERF.md). ``--speculative-config``'s ``max_verified_tokens`` sets it.
"""

from __future__ import annotations

from dataclasses import dataclass

_EMA_WEIGHT = 0.3  # of the newest step: a few steps of rejections are enough to stop
DEFAULT_MAX_VERIFIED_TOKENS = 32


@dataclass(slots=True)
class _SeqAcceptance:
    rate: float = 1.0  # optimistic: every sequence gets to try
    paused_steps: int = 0
    backoff: int = 0


class SpeculationPolicy:
    def __init__(self, k: int, min_acceptance: float = 0.25, max_verified_tokens: int = DEFAULT_MAX_VERIFIED_TOKENS,
                 first_backoff: int = 8, max_backoff: int = 256) -> None:
        if not 0.0 <= min_acceptance < 1.0:
            raise ValueError(f"min_acceptance: must be in [0, 1), got {min_acceptance}")
        self.k, self.min_acceptance, self.max_verified_tokens = k, min_acceptance, max_verified_tokens
        self.first_backoff, self.max_backoff = first_backoff, max_backoff
        self._seqs: dict[int, _SeqAcceptance] = {}

    def proposal_room(self, num_decoding: int) -> int:
        """How many proposed tokens this step may verify in all, beside ``num_decoding`` sequences'
        own (0: it does not speculate)."""
        return max(0, self.max_verified_tokens - num_decoding)

    def may_propose(self, seq_id: int) -> bool:
        """Whether the sequence is not paused (counts nothing down)."""
        st = self._seqs.get(seq_id)
        return st is None or st.paused_steps == 0

    def wants_proposals(self, seq_id: int) -> bool:
        """Whether the sequence proposes this step; a paused one counts a step down."""
        st = self._seqs.get(seq_id)
        if st is None or st.paused_steps == 0:
            return True
        st.paused_steps -= 1
        return False

    def observe(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A verified step of the sequence: ``accepted`` of its ``proposed`` tokens were kept."""
        if proposed <= 0:
            return
        st = self._seqs.setdefault(seq_id, _SeqAcceptance())
        st.rate += _EMA_WEIGHT * (accepted / proposed - st.rate)
        if st.rate < self.min_acceptance:
            st.backoff = min(self.max_backoff, st.backoff * 2 if st.backoff else self.first_backoff)
            st.paused_steps = st.backoff
            st.rate = self.min_acceptance  # one good probe round lifts it back over the bar
        elif accepted:
            st.backoff = 0  # it pays again: the next pause starts short

    def forget(self, seq_id: int) -> None:
        """The sequence finished or was aborted."""
        self._seqs.pop(seq_id, None)

    def __len__(self) -> int:
        """Sequences whose acceptance is tracked."""
        return len(self._seqs)

    def acceptance(self, seq_id: int) -> float:
        st = self._seqs.get(seq_id)
        return 1.0 if st is None else st.rate
