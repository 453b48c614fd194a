"""A plan sent to the executor and not yet answered, and the error for a result that breaks the contract.

The scheduler records each plan it sends as an :class:`InFlight` (at most two per executor, oldest
first); its result is checked against that record before anything of it is applied
(``step_output.py``, ``speculative_steps.py``), and a result that does not answer it raises
:class:`ProtocolError`: the executor, not a request, is at fault.
"""

from __future__ import annotations

import dataclasses

from pagedserve.wire import max_result_bytes
from scheduler_svc.sched.request import Sequence


class ProtocolError(ValueError):
    """A result that does not answer its plan: the executor, not a request, is at fault."""


@dataclasses.dataclass(slots=True)
class InFlight:
    """A plan sent and not yet answered: what its result must be checked and applied against."""

    step_id: int
    seq_ids: list[int]  # the sequences it computes (the plan's list)
    sampling: list[Sequence]  # sequences it samples for, in plan order (each holds a placeholder)
    beams: list[Sequence]  # beam sequences it reports candidates for (each holds a placeholder)
    to_commit: list[tuple[Sequence, int, int]]  # (seq, residency, computed count) filling a block
    forks: list = dataclasses.field(default_factory=list)  # the plan's Fork entries
    # Sequences whose prompt tokens it may score (SamplingParams.prompt_logprobs): (seq, the most it
    # can score: every prompt token before the end of this step's chunk, token 0 never).
    scoring: list[tuple[Sequence, int]] = dataclasses.field(default_factory=list)
    decode_steps: int = 1  # the plan's: each sequence of ``sampling`` gets this many tokens
    decode_only: bool = False  # every sequence it computes decodes one token per step (its time says a step's)
    # Speculative decoding: (seq, proposals, its residency) for each sequence the plan gave proposals.
    proposed_at: list[tuple[Sequence, int, int]] = dataclasses.field(default_factory=list)
    lora_loads: list[int] = dataclasses.field(default_factory=list)  # the slots the plan loads (each may fail)

    @property
    def proposed(self) -> list[tuple[Sequence, int]]:
        return [(s, d) for s, d, _ in self.proposed_at]

    def max_result_bytes(self) -> int:
        """The largest result frame this plan can be answered with (its sequences, their log-probs,
        the prompt scores of the chunks it computes, the rejections of its constrained ones)."""
        lp = num_lp = constrained = 0
        for s in self.sampling:
            sp = s.sampling
            if sp.want_logprobs:
                num_lp += 1
                lp += sp.logprobs
            if sp.structured is not None:
                constrained += 1
        beams = 0
        for s in self.beams:
            beams += s.sampling.beam_candidates
        scored = entries = 0
        for s, most in self.scoring:
            scored += most
            entries += most * s.sampling.prompt_logprobs
        return max_result_bytes(len(self.seq_ids), len(self.sampling), lp, num_lp, beams, len(self.beams),
                                scored, entries, len(self.scoring), self.decode_steps,
                                sum(d for _, d, _ in self.proposed_at), len(self.proposed_at), len(self.lora_loads),
                                constrained)

    def forget(self, dropped: set[int]) -> None:
        """The executor dropped these sequences after an earlier step failed: this plan serves none of
        them, nor the children it forks from them (``dropped`` gains those)."""
        for f in self.forks:
            if f.parent_seq_id in dropped:
                dropped.add(f.child_seq_id)
        for due in (self.sampling, self.beams):
            if any(s.seq_id in dropped for s in due):
                for s in due:
                    if s.seq_id in dropped:
                        s.num_placeholders -= 1
                due[:] = [s for s in due if s.seq_id not in dropped]
        self.to_commit[:] = [x for x in self.to_commit if x[0].seq_id not in dropped]
