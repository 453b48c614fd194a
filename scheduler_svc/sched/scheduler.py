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

A plan carries each sequence's state once per residency (``NewSeq``, or a
``Fork`` of a resident parent); after that only ids, token counts and block
changes. The order an executor applies a plan in is documented in
``pagedserve/wire/messages.py``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Collection, Mapping

from pagedserve.wire import BatchPlan, BlockUpdate, Fork, NewSeq
from scheduler_svc.sched.decode_steps import DecodeStepPolicy
from scheduler_svc.sched.in_flight import InFlight
from scheduler_svc.sched.introspection import Introspection
from scheduler_svc.sched.kv_cache_manager import NO_CHANGE, KVCacheManagerBase, SlotChange
from scheduler_svc.sched.lifecycle import Work, seeded
from scheduler_svc.sched.request import Request, RequestState, Sequence
from scheduler_svc.sched.result_handling import ResultHandling
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from scheduler_svc.sched.speculative_steps import SpeculativeSteps
from scheduler_svc.sched.step_output import OutputProcessor


@dataclasses.dataclass(slots=True)
class _Budget:
    tokens: int
    seqs: int


class Scheduler(ResultHandling, Introspection):
    """Budgets, preemption and plan building for one KV pool.

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
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
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
        step.lora_loads = len(plan.lora_loads)
        # (each sequence computed one token: nothing but decodes, and its time is a decode step's)
        step.decode_only = (self.config.max_num_batched_tokens - budget.tokens == len(step.seq_ids)
                            == len(step.sampling)) and bool(step.sampling)
        if not (step.seq_ids or plan.free_seq_ids or plan.swap_out or plan.swap_in or plan.new_seqs
                or plan.lora_loads):
            return None
        self.in_flight.append(step)
        return plan

    def _schedule_running(self, plan: BatchPlan, budget: _Budget, steps: int = 1) -> bool:
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

    def _schedule_with_preemption(self, r: Request, plan: BatchPlan, budget: _Budget) -> bool:
        """Schedule ``r``, preempting the latest arrivals while blocks are short.

        Returns False when ``r`` itself had to be preempted.
        """
        work = self._group_work(r, budget)
        if not work:
            return True
        intros = self._intros(r)
        changes = self._allocate(work, 0)
        while changes is None:
            victim = self.running[-1]
            self._preempt(victim, plan)
            self._preempted = True
            if victim is r:
                return False
            changes = self._allocate(work, 0)
        self._emit(work, changes, intros, plan, budget)
        return True

    def _group_work(self, r: Request, budget: _Budget) -> Work | None:
        """What ``r`` computes this step within ``budget``: None if it does not fit, [] if it
        waits for a result in flight (beam search chooses its next tokens from it; a sequence
        whose last token is in flight ends by length)."""
        if r.beam is not None and any(s.num_placeholders for s in r.live):
            return []
        if not r.forked:
            seq0 = r.live[0]
            target = self._prefill_target(r, seq0)  # all but the last prompt token, once; then fork
            if seq0.num_computed_tokens < target:
                return [(seq0, min(target - seq0.num_computed_tokens, budget.tokens))]
            if r.req.params.n > budget.seqs:
                return None
            self._fork_choices(r)
        live = [s for s in r.live if not (s.num_placeholders and s.num_tokens >= r.stop_len)]
        if len(live) == 1:
            seq = live[0]
            n = seq.num_tokens - seq.num_computed_tokens
            return [(seq, n if n <= budget.tokens else budget.tokens)]
        work = [(s, s.num_tokens - s.num_computed_tokens) for s in live]
        if len(work) > budget.seqs:
            return None
        if sum(n for _, n in work) <= budget.tokens:
            return work
        # Chunk the group's prefill (e.g. after recompute) so that no sequence reaches its
        # last token before all can: beams must sample in the same step.
        left, chunks = budget.tokens, []
        for s, n in work:
            k = min(n - 1, left)
            if k > 0:
                chunks.append((s, k))
                left -= k
        return chunks or None

    def _fork_choices(self, r: Request) -> None:
        """n > 1: the prompt (minus its last token) is computed once; share it n ways."""
        seq0 = r.live[0]
        sp = r.req.params.sampling
        children = []
        for i in range(1, r.req.params.n):
            child = self.new_seq(r, i, list(seq0.token_ids), seeded(sp, i))
            child.num_computed_tokens = seq0.num_computed_tokens
            child.fork_parent = seq0.seq_id
            child.fork_seed = child.sampling.seed
            children.append(child)
        self.kv.fork_many(seq0, children)  # (one pass over the prompt's blocks for all of them)
        r.forked = True

    def _intros(self, r: Request) -> list:
        """NewSeq/Fork entries owed for non-resident seqs, snapshotted before allocation."""
        out: list = []
        for s in r.live:
            if not s.resident:
                if s.num_placeholders:
                    raise RuntimeError(f"seq {s.seq_id} introduced to the executor with a sample in flight")
                if s.fork_parent is not None:
                    out.append(Fork(s.fork_parent, s.seq_id, s.fork_seed))
                else:
                    out.append(NewSeq(s.seq_id, r.packed_tokens(s), s.num_prompt_tokens, self.kv.block_ids(s),
                                      s.num_computed_tokens, s.sampling,
                                      -1 if r.lora_slot is None else r.lora_slot))
        return out

    def _allocate(self, work: Work, reserve: int) -> list[SlotChange] | None:
        """Check-then-commit for a whole request (its sequences move together)."""
        kv = self.kv
        if len(work) == 1 and not reserve:
            ch = kv.allocate(work[0][0], work[0][1])
            return None if ch is None else [ch]
        if sum(kv.blocks_needed(s, n) for s, n in work) + reserve > kv.num_free_blocks:
            return None
        changes = [kv.allocate(s, n) for s, n in work]
        if any(ch is None for ch in changes):
            raise RuntimeError("allocation failed after blocks_needed said it fits")
        return changes  # type: ignore[return-value]

    def _emit(self, work: Work, changes: list[SlotChange], intros: list, plan: BatchPlan,
              budget: _Budget) -> None:
        for x in intros:
            (plan.forks if type(x) is Fork else plan.new_seqs).append(x)
            seq = self.seqs[x.child_seq_id if type(x) is Fork else x.seq_id]
            seq.resident = True
            seq.fork_parent = None
        ids, nums, bs = plan.scheduled_seq_ids, plan.num_new_tokens, self.config.block_size
        step = self._step
        total = 0
        for (seq, n), ch in zip(work, changes, strict=True):
            if ch is not NO_CHANGE:
                self._emit_change(seq, ch, plan)
            if seq.owed_tokens:
                plan.append_tokens.extend((seq.seq_id, t) for t in seq.owed_tokens)
                seq.owed_tokens.clear()
            ids.append(seq.seq_id)
            nums.append(n)
            c = seq.num_computed_tokens
            seq.num_computed_tokens = c + n
            if c < seq.num_prompt_tokens:
                self._note_scoring(seq, c, n)
            if c + n == seq.num_tokens:  # it samples (or reports beam candidates)
                seq.num_placeholders += 1
                (step.sampling if seq.request.beam is None else step.beams).append(seq)
            if (c + n) // bs != c // bs:
                step.to_commit.append((seq, seq.residency, c + n))
            total += n
        budget.tokens -= total
        budget.seqs -= len(work)

    def _note_scoring(self, seq: Sequence, c: int, n: int) -> None:
        """A chunk of ``seq``'s prompt from ``c``: if its prompt is scored, the step's result may carry
        the scores of every prompt token before the chunk's end (the executor may run a hit's
        positions again), and its bound must allow them."""
        if seq.sampling.prompt_logprobs >= 0 and not seq.num_output_tokens:
            self._step.scoring.append((seq, min(c + n, seq.num_prompt_tokens - 1)))

    @staticmethod
    def _emit_change(seq: Sequence, ch: SlotChange, plan: BatchPlan) -> None:
        if ch.block_ids:
            plan.block_updates.append(BlockUpdate(seq.seq_id, ch.start, ch.block_ids))
        if ch.copy is not None:
            plan.copies.append(ch.copy)

    def _preempt(self, r: Request, plan: BatchPlan) -> None:
        """Take the whole request off the device: swap (if asked and room) or recompute."""
        self.running.remove(r)
        self.num_preemptions += 1
        pairs = None
        if self.config.preemption_mode == "swap":
            pairs = self.kv.swap_out(r.live)
        if pairs is not None:
            plan.swap_out.extend(pairs)
            r.state = RequestState.SWAPPED
            self.swapped.appendleft(r)
            for seq in r.live:
                if seq.resident:
                    self._owed_frees.append(seq.seq_id)
                seq.forget_executor_state()
            return
        for seq in r.live:
            self._forget(seq)
            seq.num_computed_tokens = 0
        self.unpin_lora(r)  # (recomputed later, perhaps under another slot)
        r.state = RequestState.WAITING
        self.waiting.appendleft(r)

    def _schedule_swapped(self, plan: BatchPlan, budget: _Budget) -> None:
        while self.swapped and budget.tokens > 0:
            r = self.swapped[0]
            if _awaits_result(r):
                return
            try:
                if not self._swap_in(r, plan, budget):
                    return
            except Exception as exc:  # noqa: BLE001  one request's failure must not reach the others
                self._isolate(r, plan, exc)

    def _swap_in(self, r: Request, plan: BatchPlan, budget: _Budget) -> bool:
        pairs = self.kv.swap_in(r.live, reserve=self._watermark)
        if pairs is None:
            return False
        self.swapped.popleft()
        plan.swap_in.extend(pairs)
        self._set_running(r)
        work = self._group_work(r, budget)
        if work:
            intros = self._intros(r)
            changes = self._allocate(work, self._watermark)
            if changes is not None:
                self._emit(work, changes, intros, plan, budget)
        return True

    def _schedule_waiting(self, plan: BatchPlan, budget: _Budget) -> None:
        cfg = self.config
        if not self.waiting or len(self.running) >= cfg.max_num_seqs:
            return  # (full: every running request holds at least one sequence; skips the O(running) sum)
        num_live = sum(_footprint(r) for r in self.running)
        while self.waiting and budget.tokens > 0:
            r = self.waiting[0]
            if num_live + _footprint(r) > cfg.max_num_seqs or _awaits_result(r):
                return
            try:
                if not self._admit(r, plan, budget):
                    return
            except Exception as exc:  # noqa: BLE001  one request's failure must not reach the others
                self._isolate(r, plan, exc)
                continue
            num_live += _footprint(r)

    def _admit(self, r: Request, plan: BatchPlan, budget: _Budget) -> bool:
        """Admit the head of the waiting queue with its prefix hits; False (nothing changed) if it
        does not fit (or its LoRA adapter has no slot: it waits at the head, in arrival order)."""
        if not self.pin_lora(r, plan.lora_loads):
            return False
        hit_tokens = self._take_prefix_hits(r, budget.tokens)
        if hit_tokens is None:
            self.unpin_lora(r)  # (a load it caused stays in the plan: the slot holds that adapter now)
            return False
        work = self._group_work(r, budget)
        intros = self._intros(r) if work else []
        changes = self._allocate(work, self._watermark) if work else None
        if changes is None:
            self._unadmit(r)
            self.unpin_lora(r)
            return False
        self.waiting.popleft()
        self._set_running(r)
        if r.req.first_scheduled_at is None:  # not after preemption or migration
            r.req.first_scheduled_at = time.monotonic()
            self.first_scheduled.append(r.req)
        self._emit(work, changes, intros, plan, budget)  # type: ignore[arg-type]
        self._count_prefix(r, hit_tokens)
        return True

    def _isolate(self, r: Request, plan: BatchPlan, exc: Exception) -> None:
        """Fail ``r`` alone: take what it put into this plan back out, then release it."""
        mine = {s.seq_id for s in r.seqs}
        kept = [(i, n) for i, n in zip(plan.scheduled_seq_ids, plan.num_new_tokens, strict=True) if i not in mine]
        plan.scheduled_seq_ids[:] = [i for i, _ in kept]  # (in place: the InFlight record shares it)
        plan.num_new_tokens[:] = [n for _, n in kept]
        plan.new_seqs[:] = [x for x in plan.new_seqs if x.seq_id not in mine]
        plan.forks[:] = [x for x in plan.forks if x.child_seq_id not in mine]
        plan.block_updates[:] = [x for x in plan.block_updates if x.seq_id not in mine]
        plan.append_tokens[:] = [x for x in plan.append_tokens if x[0] not in mine]
        step = self._step
        for due in (step.sampling, step.beams):
            for s in due:
                if s.seq_id in mine:
                    s.num_placeholders -= 1
            due[:] = [s for s in due if s.seq_id not in mine]
        step.to_commit[:] = [x for x in step.to_commit if x[0].seq_id not in mine]
        self.failures.append(self.fail_request(r, exc))

    def take_all_requests(self):
        if self.spec is not None:
            self.spec.pending.clear()  # (their results will not be applied)
        return super().take_all_requests()


def _awaits_result(r: Request) -> bool:
    """A preempted request whose sample is still in flight: (re)admit it once that result came."""
    return any(s.num_placeholders for s in r.live)


def _footprint(r: Request) -> int:
    """Sequences a request may hold at once (beams and choices count before they exist)."""
    p = r.req.params
    return max(len(r.live), p.beam_width if r.beam is not None else (p.n if not r.forked else 1))
