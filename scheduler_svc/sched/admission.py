"""Admission: the waiting queue's requests, first come first served, becoming running ones.

A step admits waiting requests only when nothing is preempted or swapped out, within the token
and sequence budgets, keeping the watermark of blocks free. The head of the queue is admitted
whole or not at all: its LoRA adapter gets a slot (or it waits, in arrival order), each sequence
takes its cached prefix blocks (a scored prompt takes none), then its first chunk is allocated;
when anything does not fit, what it took goes back and it waits at the head of the queue. A
one-sequence request coming back (after preemption by recompute, or migration) waits until all it
must compute fits, not its first chunk alone (``_fits``).
"""

from __future__ import annotations

import time

from pagedserve.engine_api import GenerationRequest
from pagedserve.wire import BatchPlan
from scheduler_svc.sched.kv_cache_manager import NO_HIT, PrefixHit
from scheduler_svc.sched.plan_building import PlanBuilding, StepBudget
from scheduler_svc.sched.preemption import awaits_result
from scheduler_svc.sched.request import Request, Sequence


def takes_prefix_hits(req: GenerationRequest) -> bool:
    """A request whose prompt is scored computes all of it, as in vLLM: the executor would run a
    hit's positions again to score them, work no step's token budget counts."""
    return req.params.sampling.prompt_logprobs < 0


class Admission(PlanBuilding):
    """Admission of waiting requests with their prefix hits, mixed into ``Scheduler``."""

    def _schedule_waiting(self, plan: BatchPlan, budget: StepBudget) -> None:
        cfg = self.config
        if not self.waiting or len(self.running) >= cfg.max_num_seqs:
            return  # (full: every running request holds at least one sequence; skips the O(running) sum)
        num_live = sum(_footprint(r) for r in self.running)
        while self.waiting and budget.tokens > 0:
            r = self.waiting[0]
            if num_live + _footprint(r) > cfg.max_num_seqs or awaits_result(r):
                return
            try:
                if not self._admit(r, plan, budget):
                    return
            except Exception as exc:  # noqa: BLE001  one request's failure must not reach the others
                self._isolate(r, plan, exc)
                continue
            num_live += _footprint(r)

    def _admit(self, r: Request, plan: BatchPlan, budget: StepBudget) -> bool:
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
        self._count_prefix(r, hit_tokens)  # (before _emit adds the placeholders of samples due)
        self._emit(work, changes, intros, plan, budget)  # type: ignore[arg-type]
        return True

    def _take_prefix_hits(self, r: Request, max_tokens: int) -> list[int] | None:
        """Give each seq of ``r`` (being admitted) its cached prefix blocks, check-then-commit per
        seq; None (nothing changed) when they, or a first chunk of up to ``max_tokens`` after
        them, cannot fit."""
        hits = []
        known = r.req.prompt_block_hashes or ()  # every seq of r starts with the prompt
        takes_hits = takes_prefix_hits(r.req)
        single = len(r.live) == 1
        back = single and r.req.first_scheduled_at is not None  # after preemption or migration: whole
        for seq in r.live:
            hit = self.kv.lookup_prefix(seq, known) if takes_hits else NO_HIT
            if (back or (single and hit.blocks)) and not self._fits(r, seq, hit, None if back else max_tokens):
                self._unadmit(r)
                return None
            if self.kv.allocate(seq, 0, hit) is None:
                self._unadmit(r)
                return None
            seq.num_computed_tokens = hit.num_tokens
            hits.append(hit.num_tokens)
        return hits

    def _fits(self, r: Request, seq: Sequence, hit: PrefixHit, max_tokens: int | None) -> bool:
        """Whether a one-sequence request's hits plus what it computes first (a chunk of at most
        ``max_tokens``; None: all it must compute) fit with the watermark kept: the check
        ``_allocate`` makes after the hits are taken, made before. A request waiting at the head of
        the queue is retried every step, and taking then returning its hits costs two refcount
        changes per hit block (a preempted 32K-token request: ~2K blocks, milliseconds per step).
        True when it cannot tell (an n > 1 request whose hits cover its shared prefill: it forks
        its choices next).

        A request coming back after preemption or migration is checked whole (``max_tokens``
        None). Admitted on its first chunk, as a new request is, a pool that cannot hold it
        thrashes: it is the latest arrival the moment the running requests grow into the blocks
        its preemption freed, so it is preempted again every few steps, each time after
        recomputing part of itself (``benchmarks/preemption_recompute.py``: 49x the tokens needed
        without prefix caching, 5.7x with it). Checked whole, it comes back when a request has
        finished, and stays. Its cached blocks (``hit``) count as held: with prefix caching they
        are most of it."""
        target = self._prefill_target(r, seq)
        if target <= hit.num_tokens:
            return True
        n = target - hit.num_tokens if max_tokens is None else min(target - hit.num_tokens, max_tokens)
        return self.kv.blocks_needed(seq, n, hit) + self._watermark <= self.kv.num_free_blocks

    def _unadmit(self, r: Request) -> None:
        """Undo a failed admission: hit blocks go back to the cache, nothing was sent."""
        for seq in r.live:
            self.kv.free(seq)
            seq.residency += 1
            seq.num_computed_tokens = 0
            seq.forget_executor_state()  # choices forked during the attempt get NewSeq later

    def _count_prefix(self, r: Request, hits: list[int]) -> None:
        """Count the tokens ``r``'s sequences looked up (their known tokens, as vLLM counts a
        request's) and found."""
        for seq, h in zip(r.live[: len(hits)], hits, strict=True):  # choices forked at admission share the hit
            self.prefix_cache_query_tokens += seq.num_tokens
            self.prefix_cache_hit_tokens += h
        if r.emitted_seqs == 0 and not r.num_cached_prompt_tokens and hits:
            r.num_cached_prompt_tokens = min(hits[0], r.num_prompt_tokens)


def _footprint(r: Request) -> int:
    """Sequences a request may hold at once (beams and choices count before they exist)."""
    p = r.req.params
    return max(len(r.live), p.beam_width if r.beam is not None else (p.n if not r.forked else 1))
