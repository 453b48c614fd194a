"""Applying a step's result: ``update()``, in the order results come back, and failures it reports.

A result answers the oldest plan in flight (:class:`~scheduler_svc.sched.in_flight.InFlight`), and
one that does not raises ``ProtocolError`` (the engine drops that executor). Applying it: the
LoRA loads it failed fail the requests pinned to their slots, the blocks the step filled go to
the prefix cache, the samples become tokens and updates (``step_output.py``), proposals are
verified (``speculative_steps.py``), and the sequences the executor dropped fail their requests
and leave the plans sent after it. Planning a step is ``scheduler.py``'s.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from pagedserve.engine_api import ErrorKind, RequestUpdate
from pagedserve.wire import SeqRejection, StepResult
from scheduler_svc.sched.in_flight import ProtocolError
from scheduler_svc.sched.lifecycle import RequestLifecycle

if TYPE_CHECKING:
    from scheduler_svc.sched.decode_steps import DecodeStepPolicy
    from scheduler_svc.sched.speculative_steps import SpeculativeSteps
    from scheduler_svc.sched.step_output import OutputProcessor

log = logging.getLogger("scheduler_svc.sched.scheduler")  # (its records kept their logger when this was split out)


class ResultHandling(RequestLifecycle):
    """``update()`` and the failures a result (or the engine) reports, mixed into ``Scheduler``."""

    # Set by Scheduler.__init__; the planning side uses the last two as well.
    _out: OutputProcessor
    decode_policy: DecodeStepPolicy
    spec: SpeculativeSteps | None

    def update(self, result: StepResult) -> list[RequestUpdate]:
        """Apply the result of the oldest plan in flight; returns per-request news.

        ProtocolError (a ValueError) for a result that does not answer that plan, checked before
        anything changes: the executor broke the contract, and the engine drops it. A refused plan
        is not a result to apply: the engine takes every request back first (``take_all_requests``),
        after which the answers to the plans it had in flight are ignored here.
        """
        if result.step_id in self._stale_steps:  # a plan dropped by take_all_requests
            self._stale_steps.discard(result.step_id)
            return []
        if not self.in_flight:
            raise ProtocolError(f"update: no plan in flight (result for step {result.step_id})")
        step = self.in_flight[0]
        if result.step_id != step.step_id:
            raise ProtocolError(f"update: result for step {result.step_id}, the oldest plan in flight is "
                                f"{step.step_id}")
        if result.refused:
            raise RuntimeError(f"update: plan {result.step_id} was refused; take the requests back instead")
        failed = set(result.failed_seq_ids)
        due = self._out.check(result, step, failed)  # before anything changes: a bad result changes nothing
        failed_loads = [f.slot for f in result.lora_failures]
        if len(set(failed_loads)) != len(failed_loads) or not set(failed_loads) <= set(step.lora_loads):
            raise ProtocolError(f"update: LoRA load failures for slots {failed_loads}; its plan loaded slots "
                                f"{step.lora_loads}")
        if self.spec is not None and (step.proposed_at or result.spec_tokens):
            self.spec.check(result, step, failed, self._out)
        elif result.spec_tokens:
            raise ProtocolError(f"update: result {result.step_id} has speculative tokens; this scheduler proposes none")
        self.in_flight.popleft()
        for f in result.lora_failures:
            self._lora_failed(f.slot, f.reason)
        if not failed:
            self.decode_policy.observe(step, result)
        if step.decode_steps > 1:  # (its later steps' inputs are its samples: committed with them)
            updates = self._out.process_steps(result, due, step, failed)
            return updates + self._fail_dropped(failed, result.rejected) if failed else updates
        commit = self.kv.commit_computed
        for seq, residency, computed in step.to_commit:  # computed now: safe to share via the cache
            if seq.finish_reason is None and seq.residency == residency and seq.seq_id not in failed:
                commit(seq, computed)  # (before the samples: a sequence they finish frees its blocks)
        if not failed:
            updates = self._out.process(result, step.sampling, step.beams)
            if step.proposed_at:
                self.spec.apply(result, step, updates, failed, self._out)
            return updates
        for s in step.sampling + step.beams:
            if s.seq_id in failed:
                s.num_placeholders -= 1  # its sample never comes
        updates = self._out.process(result, due, [s for s in step.beams if s.seq_id not in failed])
        if step.proposed_at:
            self.spec.apply(result, step, updates, failed, self._out)
        return updates + self._fail_dropped(failed, result.rejected)

    def _lora_failed(self, slot: int, reason: str) -> None:
        """The executor could not load ``slot``'s adapter: every request pinned to it fails with the
        reason (the executor drops their sequences, in this plan and in those behind it, until the
        slot is loaded again), and the slot is empty."""
        name = self.lora.held().get(slot)
        log.error("the executor could not load LoRA adapter %r into slot %d: %s", name, slot, reason)
        doomed = [r for r in self.requests.values() if r.lora_slot == slot and r.live]
        dropped = {s.seq_id for r in doomed for s in r.live}
        for later in self.in_flight:
            later.forget(set(dropped))
        self.failures += self._out.fail([r.live[0] for r in doomed], f"LoRA adapter {name!r} could not be "
                                                                     f"loaded: {reason}")
        self.lora.unload(slot)

    def _fail_dropped(self, failed: set[int], rejected: list[SeqRejection]) -> list[RequestUpdate]:
        """The executor dropped ``failed`` (its step could not serve them): the plans behind it serve
        none of them, and the requests that own them fail; those ``rejected`` for what they asked
        as invalid, each told its own reason."""
        dropped = set(failed)
        for later in self.in_flight:
            later.forget(dropped)
        out: list[RequestUpdate] = []
        for r in rejected:  # (first: a request with a rejected sequence is told why, not "failed")
            if r.seq_id in self.seqs:
                out += self._out.fail([self.seqs[r.seq_id]], f"structured outputs: {r.reason}", ErrorKind.INVALID)
        return out + self._out.fail([self.seqs[i] for i in failed if i in self.seqs], "the executor failed its step")

    def fail_seqs(self, seq_ids: list[int], error: str) -> list[RequestUpdate]:
        """Fail the requests that own these sequences (those still here)."""
        return self._out.fail([self.seqs[i] for i in seq_ids if i in self.seqs], error)
