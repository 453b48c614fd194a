"""One request's share of the plan being built: its work this step and the entries that carry it.

What a request computes within the step's budget (a prefill chunk; an n > 1 request's prompt once,
then its choices forked; a beam group's sequences all reaching their last token together), the
``NewSeq``/``Fork`` that introduce its sequences to the executor, the blocks for all of them
allocated check-then-commit, and the entries emitted into the plan and its ``InFlight`` record;
and, when the request fails alone, all of that taken back out. The running, swapped and waiting
phases of ``schedule()`` (``scheduler.py``, ``preemption.py``) all go through these.

A plan carries each sequence's state once per residency (``NewSeq``, or a ``Fork`` of a resident
parent); after that only ids, token counts and block changes. The order an executor applies a
plan in is documented in ``pagedserve/wire/messages.py``.
"""

from __future__ import annotations

import dataclasses

from pagedserve.wire import BatchPlan, BlockUpdate, Fork, NewSeq
from scheduler_svc.sched.in_flight import InFlight
from scheduler_svc.sched.kv_cache_manager import NO_CHANGE, SlotChange
from scheduler_svc.sched.lifecycle import RequestLifecycle, seeded
from scheduler_svc.sched.request import Request, Sequence

Work = list[tuple[Sequence, int]]  # (sequence, num_new_tokens) scheduled in one step


@dataclasses.dataclass(slots=True)
class StepBudget:
    """What the plan being built may still take: tokens (``max_num_batched_tokens``) and
    sequences (``max_num_seqs``)."""

    tokens: int
    seqs: int


class PlanBuilding(RequestLifecycle):
    """Plan entries for one request at a time, mixed into ``Scheduler``."""

    _step: InFlight  # the record of the plan being built (set by Scheduler.schedule)

    def _group_work(self, r: Request, budget: StepBudget) -> Work | None:
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

    @staticmethod
    def _prefill_target(r: Request, seq: Sequence) -> int:
        """The tokens of ``seq`` its request computes before anything else: all of them, or for
        an n > 1 request not forked yet all but the last prompt token (computed once, then shared
        by the choices it forks into)."""
        return seq.num_tokens if r.forked else seq.num_tokens - 1

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
              budget: StepBudget) -> None:
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
