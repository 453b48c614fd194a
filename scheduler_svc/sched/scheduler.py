"""Continuous batching over one executor's paged KV cache.

One :class:`Scheduler` per executor (one KV pool); the engine keeps several
and routes requests between them. The step model::

    plan = sched.schedule()        # BatchPlan (deltas) or None
    result = executor.run(plan)    # StepResult
    updates = sched.update(result) # list[RequestUpdate]

``schedule()`` may be called again before the previous plan's result came back
(asynchronous scheduling: the engine keeps the executor's next plan queued). A
sequence sampling in a plan still in flight holds a placeholder token
(``Sequence.num_placeholders``) that the next plan computes; results are applied in
plan order. What cannot be planned ahead waits for its result: beam search
(the next step depends on which beams survive), a request whose last token is
already in flight (it ends by length), and re-admission of a preempted request
whose sample is still in flight.

Each ``schedule()``:

1. running requests, oldest first: each gets its next tokens (decode: 1;
   prefill: a chunk that fits the token budget). When blocks run out the
   latest-arrived running request is preempted as a whole — swapped to the
   CPU pool (``preemption_mode="swap"`` and room there) or dropped for
   recompute — until the current request fits (or is itself the victim);
2. if nothing was preempted: swapped requests come back (FCFS) while the
   device keeps ``watermark`` blocks free;
3. if nothing is swapped: waiting requests are admitted FCFS with their
   prefix-cache hits, within the token, sequence and watermark budgets.

:class:`Scheduler` is ``schedule()`` and step 1's loop (a decoding sequence is
planned inline there: it runs for every running sequence every step) over
mixins, one piece of the step each:

- ``plan_building.py``: one request's work within the budget and the plan
  entries that carry it (all three steps go through it);
- ``preemption.py``: preemption by swap or recompute (1), swap-in (2);
- ``admission.py``: admission with prefix-cache hits (3);
- ``result_handling.py``: ``update()``, a result applied to its plan;
- ``introspection.py``: the counters and ``check_integrity()``;
- ``lifecycle.py``, under all of them: the queues and indexes, intake, the
  one release path, migration.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

from pagedserve.engine_api import FinishReason
from pagedserve.wire import BatchPlan
from scheduler_svc.sched.admission import Admission
from scheduler_svc.sched.decode_steps import DecodeStepPolicy
from scheduler_svc.sched.in_flight import InFlight
from scheduler_svc.sched.introspection import Introspection
from scheduler_svc.sched.kv_cache_manager import NO_CHANGE, KVCacheManagerBase
from scheduler_svc.sched.plan_building import StepBudget
from scheduler_svc.sched.preemption import Preemption
from scheduler_svc.sched.request import Sequence
from scheduler_svc.sched.result_handling import ResultHandling
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from scheduler_svc.sched.speculative_steps import SpeculativeSteps
from scheduler_svc.sched.step_output import OutputProcessor


class Scheduler(Preemption, Admission, ResultHandling, Introspection):
    """One KV pool's scheduler: the step model above, made of the mixins listed there.

    ``kv_manager`` replaces the paged :class:`KVCacheManager` (e.g. with a
    contiguous-reservation baseline implementing ``KVCacheManagerBase``).
    """

    def __init__(self, config: SchedulerConfig, num_device_blocks: int, num_cpu_blocks: int,
                 eos_token_ids: Collection[int], kv_manager: KVCacheManagerBase | None = None,
                 vocab_size: int | None = None, lora_paths: Mapping[str, str] | None = None) -> None:
        super().__init__(config, num_device_blocks, num_cpu_blocks, eos_token_ids, kv_manager, lora_paths)
        self._out = OutputProcessor(self, vocab_size)
        self.decode_policy = DecodeStepPolicy(config.decode_steps if config.speculative is None else 1)
        self.spec = SpeculativeSteps(config.speculative) if config.speculative is not None else None

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> BatchPlan | None:
        """Build the next plan, or None when there is nothing to run or tell."""
        self._step_id += 1
        plan = BatchPlan(self._step_id)
        budget = StepBudget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        step = self._step = InFlight(self._step_id, plan.scheduled_seq_ids, [], [], [], plan.forks)
        steps = self.decode_policy.choose(self)
        preempted = self._schedule_running(plan, budget, steps)
        if steps > 1 and step.sampling:
            plan.decode_steps = step.decode_steps = steps
        if not preempted:
            self._schedule_swapped(plan, budget)
            if not self.swapped:
                self._schedule_waiting(plan, budget)
        plan.free_seq_ids = self._owed_frees
        self._owed_frees = []
        step.lora_loads = [load.slot for load in plan.lora_loads]
        # (each sequence computed one token: nothing but decodes, and its time is a decode step's)
        step.decode_only = (self.config.max_num_batched_tokens - budget.tokens == len(step.seq_ids)
                            == len(step.sampling)) and bool(step.sampling)
        if not (step.seq_ids or plan.free_seq_ids or plan.swap_out or plan.swap_in or plan.new_seqs
                or plan.lora_loads):
            return None
        self.in_flight.append(step)
        return plan

    def _schedule_running(self, plan: BatchPlan, budget: StepBudget, steps: int = 1) -> bool:
        """Running requests oldest first (each decoding ``steps`` tokens when more than 1: the decode
        policy found every one decoding, with room); returns whether anyone was preempted."""
        self._preempted = False
        running, allocate, bs = self.running, self.kv.allocate, self.config.block_size
        ids, nums = plan.scheduled_seq_ids, plan.num_new_tokens
        spec_room = self.spec.proposal_room(len(running)) if self.spec is not None else 0
        spec = self.spec if spec_room > 0 else None
        pending = self.spec.pending if self.spec is not None else ()
        sampling, to_commit = self._step.sampling, self._step.to_commit
        i = 0
        while i < len(running) and budget.tokens > 0 and budget.seqs > 0:
            r = running[i]
            try:
                live = r.live
                if len(live) == 1 and r.beam is None and r.forked and live[0].resident:
                    # The decode case (one resident sequence, nothing owed), inline: it runs for
                    # every running sequence every step.
                    seq = live[0]
                    c = seq.num_computed_tokens
                    total = len(seq.token_ids) + seq.num_placeholders
                    if (seq.num_placeholders and total >= r.stop_len) or seq.seq_id in pending or (
                            spec is not None and seq.num_placeholders and spec.waits(r, seq)):
                        i += 1  # its last token is in flight: it ends by length when that result comes (or
                        continue  # its proposals' result, or it will propose once that token is known)
                    n = total - c if total - c <= budget.tokens else budget.tokens
                    # k decode steps write k positions and sample k placeholders.
                    k = steps if steps > 1 else n
                    props = (spec.propose(r, seq, total, min(budget.tokens - 1, spec_room))
                             if spec is not None and n == 1 and total - c == 1 and not seq.num_placeholders else None)
                    ch = allocate(seq, k + len(props)) if props else allocate(seq, k)
                    if ch is not None and props:
                        spec.put(plan, seq.seq_id, props)
                        self._step.proposed_at.append((seq, len(props), seq.residency))
                        spec.pending.add(seq.seq_id)
                        budget.tokens -= len(props)
                        spec_room -= len(props)
                    if ch is not None:
                        if ch is not NO_CHANGE:
                            self._emit_change(seq, ch, plan)
                        ids.append(seq.seq_id)
                        nums.append(n)
                        seq.num_computed_tokens = c + k  # counted at schedule time, as in vLLM v1
                        if c < seq.num_prompt_tokens:  # (a prompt chunk: its scores may be owed)
                            self._note_scoring(seq, c, n)
                        if c + n == total:  # it samples: placeholders until the result comes
                            seq.num_placeholders += steps
                            sampling.append(seq)
                        if (c + k) // bs != c // bs:  # cache its newly full block once the step returns
                            to_commit.append((seq, seq.residency, c + k))
                        budget.tokens -= n
                        budget.seqs -= 1
                        i += 1
                        continue
                if not self._schedule_with_preemption(r, plan, budget):
                    break  # r itself was preempted: everyone after it is gone too
                i += 1
            except Exception as exc:  # noqa: BLE001  one request's failure must not reach the others
                self._isolate(r, plan, exc)  # r left `running`: the next request is at index i now
        return self._preempted

    def take_all_requests(self):
        if self.spec is not None:
            self.spec.pending.clear()  # (their results will not be applied)
        return super().take_all_requests()

    def finish_seq(self, seq: Sequence, reason: FinishReason) -> None:
        super().finish_seq(seq, reason)
        if self.spec is not None:  # (however it ends: by a step that did not speculate, aborted, a stop string)
            self.spec.forget(seq.seq_id)
