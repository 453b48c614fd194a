"""Continuous batching over one executor's paged KV cache.

One :class:`Scheduler` per executor (one KV pool); the engine keeps several
and routes requests between them. The step model is synchronous::

    plan = sched.schedule()        # BatchPlan (deltas) or None
    result = executor.run(plan)    # StepResult
    updates = sched.update(result) # list[RequestUpdate]

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
changes. The application order is plan.py's.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections import deque

from scheduler_svc.api_types import FinishReason, GenerationRequest
from scheduler_svc.kv_cache_manager import NO_CHANGE, KVCacheManager, KVCacheManagerBase, SlotChange
from scheduler_svc.plan import BatchPlan, BlockUpdate, Fork, NewSeq, StepResult
from scheduler_svc.request import (
    BeamState,
    MigratedRequest,
    Request,
    RequestState,
    RequestUpdate,
    Sequence,
)
from scheduler_svc.sched_config import SchedulerConfig
from scheduler_svc.step_output import OutputProcessor

_Work = list[tuple[Sequence, int]]  # (sequence, num_new_tokens) of one request this step


@dataclasses.dataclass(slots=True)
class _Budget:
    tokens: int
    seqs: int


class Scheduler:
    """Queues, budgets, preemption and plan building for one KV pool."""

    def __init__(self, config: SchedulerConfig, num_device_blocks: int, num_cpu_blocks: int,
                 eos_token_id: int | None, kv_manager: KVCacheManagerBase | None = None) -> None:
        self.config = config
        self.eos_token_id = eos_token_id
        self.kv: KVCacheManagerBase = kv_manager or KVCacheManager(
            config.block_size, num_device_blocks, num_cpu_blocks, config.enable_prefix_caching)
        self._watermark = config.watermark_blocks(num_device_blocks)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # sorted by arrival; the tail is the preemption victim
        self.swapped: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, Sequence] = {}  # live sequences by seq_id
        self._next_seq_id = 0
        self._next_arrival = 0
        self._step_id = 0
        self._pending_free: list[int] = []  # executor-resident seq ids to forget in the next plan
        self._inflight: _Work | None = None  # what the plan in flight computes
        self._stale_step: int | None = None  # a plan dropped by take_all_requests
        self._preempted = False  # set during one schedule() when someone was preempted
        self.num_preemptions = 0
        self.prefix_cache_query_tokens = 0
        self.prefix_cache_hit_tokens = 0
        self._out = OutputProcessor(self)

    # ------------------------------------------------------------------ requests in/out
    def add_request(self, req: GenerationRequest, resume: MigratedRequest | None = None) -> None:
        """Queue a request (``resume``: continue one taken from another scheduler)."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already queued")
        self._validate(req)
        p = req.params
        r = Request(req, self._next_arrival, eos_token_id=None if p.ignore_eos else self.eos_token_id,
                    stop_token_ids=frozenset(p.stop_token_ids), max_tokens=p.max_tokens)
        self._next_arrival += 1
        if p.beam_width > 1:
            r.beam = BeamState(p.beam_width)
            sp = dataclasses.replace(p.sampling, beam_candidates=2 * p.beam_width, temperature=0.0)
            self._new_seq(r, 0, list(req.prompt_token_ids), sp)
        elif resume is not None and any(resume.outputs):
            self._resume_seqs(r, resume)
            if not r.live:
                for seq in r.seqs:
                    self.seqs.pop(seq.seq_id, None)
                raise ValueError(f"resume of {req.request_id!r}: every choice already finished")
        else:
            self._new_seq(r, 0, list(req.prompt_token_ids), p.sampling)
            r.forked = p.n == 1
        self.requests[req.request_id] = r
        self.waiting.append(r)

    def _validate(self, req: GenerationRequest) -> None:
        cfg, n = self.config, len(req.prompt_token_ids)
        if n == 0:
            raise ValueError("prompt_token_ids must not be empty")
        if n >= cfg.max_model_len:
            raise ValueError(f"prompt of {n} tokens must be shorter than max_model_len {cfg.max_model_len}")
        if req.params.max_tokens <= 0:
            raise ValueError(f"max_tokens must be positive, got {req.params.max_tokens}")
        width = max(req.params.n, req.params.beam_width)
        if width > min(cfg.max_num_seqs, cfg.max_num_batched_tokens):
            raise ValueError(f"n/beam_width {width} exceeds max_num_seqs {cfg.max_num_seqs} "
                             f"or max_num_batched_tokens {cfg.max_num_batched_tokens}")
        longest = min(n + req.params.max_tokens, cfg.max_model_len)
        need = width * -(-longest // cfg.block_size)
        if need > self.kv.num_device_blocks - self._watermark:
            raise ValueError(f"request needs up to {need} KV blocks; this pool has "
                             f"{self.kv.num_device_blocks - self._watermark} usable")

    def _new_seq(self, r: Request, index: int, tokens: list[int], sampling) -> Sequence:
        seq = Sequence(self._next_seq_id, index, tokens, r.num_prompt_tokens, sampling, r)
        self._next_seq_id += 1
        r.seqs.append(seq)
        r.live.append(seq)
        self.seqs[seq.seq_id] = seq
        return seq

    def _resume_seqs(self, r: Request, m: MigratedRequest) -> None:
        p = r.req.params
        for i, out in enumerate(m.outputs):
            seq = self._new_seq(r, i, list(r.req.prompt_token_ids) + list(out), _seeded(p.sampling, i))
            reason = m.finish_reasons[i] if i < len(m.finish_reasons) else None
            if reason is not None:
                seq.finish_reason = reason
                r.live.remove(seq)
                del self.seqs[seq.seq_id]
                r.emitted_seqs += 1

    def abort_request(self, request_id: str) -> None:
        """Drop a request now (idempotent); the next plan tells the executor."""
        r = self.requests.get(request_id)
        if r is not None:
            self._finish_request(r, FinishReason.ABORTED)

    def finish_sequence(self, request_id: str, seq_index: int, reason: FinishReason) -> bool:
        """End one choice (a stop string matched). Returns True if the request is now done."""
        r = self.requests.get(request_id)
        if r is None:
            return True
        if r.beam is not None:
            raise ValueError("finish_sequence: beam search choices end only inside the scheduler")
        for seq in r.live:
            if seq.index == seq_index:
                self.finish_seq(seq, reason)
                break
        if not r.live and r.forked:
            self._finish_request(r, None)
            return True
        return False

    def finish_seq(self, seq: Sequence, reason: FinishReason) -> None:
        """The one release path of a sequence (also used by preemption-free finishes)."""
        seq.finish_reason = reason
        self._forget(seq)
        seq.request.live.remove(seq)
        self.seqs.pop(seq.seq_id, None)

    def _forget(self, seq: Sequence) -> None:
        self.kv.free(seq)
        if seq.resident:
            self._pending_free.append(seq.seq_id)
        seq.forget_executor_state()

    def _finish_request(self, r: Request, reason: FinishReason | None) -> None:
        """Release every block of ``r`` and drop it from all queues (idempotent)."""
        if r.state is RequestState.FINISHED:
            return
        for seq in list(r.live):
            self.finish_seq(seq, reason or FinishReason.ABORTED)
        if r.state is RequestState.RUNNING:
            self.running.remove(r)
        elif r.state is RequestState.WAITING:
            self.waiting.remove(r)
        elif r.state is RequestState.SWAPPED:
            self.swapped.remove(r)
        r.state = RequestState.FINISHED
        self.requests.pop(r.request_id, None)

    def take_all_requests(self) -> list[MigratedRequest]:
        """Remove every request and free all blocks; return what re-queues each elsewhere."""
        out = []
        for r in sorted(self.requests.values(), key=lambda r: r.arrival):
            n = r.req.params.n if r.beam is None else 0
            outputs: list[list[int]] = [[] for _ in range(n)]
            reasons: list[FinishReason | None] = [None] * n
            for seq in r.seqs if r.beam is None else ():
                outputs[seq.index] = seq.output_token_ids
                reasons[seq.index] = seq.finish_reason
            out.append(MigratedRequest(r.req, outputs, reasons))
            self._finish_request(r, FinishReason.ABORTED)
        if self._inflight is not None:
            self._stale_step, self._inflight = self._step_id, None
        return out

    # ------------------------------------------------------------------ schedule
    def schedule(self) -> BatchPlan | None:
        """Build the next plan, or None when there is nothing to run or tell."""
        if self._inflight is not None:
            raise RuntimeError("schedule() called again before update() of the plan in flight")
        self._step_id += 1
        plan = BatchPlan(self._step_id)
        budget = _Budget(self.config.max_num_batched_tokens, self.config.max_num_seqs)
        self._inflight = []
        preempted = self._schedule_running(plan, budget)
        if not preempted:
            self._schedule_swapped(plan, budget)
            if not self.swapped:
                self._schedule_waiting(plan, budget)
        plan.free_seq_ids = self._pending_free
        self._pending_free = []
        if not (self._inflight or plan.free_seq_ids or plan.swap_out or plan.swap_in or plan.new_seqs):
            self._inflight = None
            return None
        return plan

    def _schedule_running(self, plan: BatchPlan, budget: _Budget) -> bool:
        """Running requests oldest first; returns whether anyone was preempted."""
        self._preempted = False
        running, kv_allocate = self.running, self.kv.allocate
        ids, nums, inflight = plan.scheduled_seq_ids, plan.num_new_tokens, self._inflight
        tokens, nseqs = budget.tokens, budget.seqs  # locals in the hot loop; synced around slow paths
        i = 0
        while i < len(running) and tokens > 0 and nseqs > 0:
            r = running[i]
            live = r.live
            if len(live) == 1 and r.beam is None and r.forked and live[0].resident:
                # Hot path (one resident sequence, nothing owed), inlined for speed.
                seq = live[0]
                n = len(seq.token_ids) - seq.num_computed_tokens
                if n > tokens:
                    n = tokens
                ch = kv_allocate(seq, n)
                if ch is not None:
                    if ch is not NO_CHANGE:
                        self._emit_change(seq, ch, plan)
                    ids.append(seq.seq_id)
                    nums.append(n)
                    inflight.append((seq, n))  # type: ignore[union-attr]
                    tokens -= n
                    nseqs -= 1
                    i += 1
                    continue
            budget.tokens, budget.seqs = tokens, nseqs
            ok = self._schedule_with_preemption(r, plan, budget)
            tokens, nseqs = budget.tokens, budget.seqs
            if not ok:
                break  # r itself was preempted: everyone after it is gone too
            i += 1
        budget.tokens, budget.seqs = tokens, nseqs
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

    def _group_work(self, r: Request, budget: _Budget) -> _Work | None:
        """What ``r`` computes this step within ``budget``, or None if it does not fit."""
        if not r.forked:
            seq0 = r.live[0]
            target = seq0.num_tokens - 1  # prefill all but the last prompt token once, then fork
            if seq0.num_computed_tokens < target:
                return [(seq0, min(target - seq0.num_computed_tokens, budget.tokens))]
            if r.req.params.n > budget.seqs:
                return None
            self._fork_choices(r)
        live = r.live
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
        for i in range(1, r.req.params.n):
            child = self._new_seq(r, i, list(seq0.token_ids), _seeded(sp, i))
            child.num_computed_tokens = seq0.num_computed_tokens
            self.kv.fork(seq0, child)
            child.fork_parent = seq0.seq_id
            child.fork_seed = child.sampling.seed
        r.forked = True

    def _intros(self, r: Request) -> list:
        """NewSeq/Fork entries owed for non-resident seqs, snapshotted before allocation."""
        out: list = []
        for s in r.live:
            if not s.resident:
                if s.fork_parent is not None:
                    out.append(Fork(s.fork_parent, s.seq_id, s.fork_seed))
                else:
                    out.append(NewSeq(s.seq_id, list(s.token_ids), s.num_prompt_tokens,
                                      self.kv.block_ids(s), s.num_computed_tokens, s.sampling))
        return out

    def _allocate(self, work: _Work, reserve: int) -> list[SlotChange] | None:
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

    def _emit(self, work: _Work, changes: list[SlotChange], intros: list, plan: BatchPlan,
              budget: _Budget) -> None:
        for x in intros:
            (plan.forks if type(x) is Fork else plan.new_seqs).append(x)
            seq = self.seqs[x.child_seq_id if type(x) is Fork else x.seq_id]
            seq.resident = True
            seq.fork_parent = None
        ids, nums, inflight = plan.scheduled_seq_ids, plan.num_new_tokens, self._inflight
        total = 0
        for (seq, n), ch in zip(work, changes, strict=True):
            if ch is not NO_CHANGE:
                self._emit_change(seq, ch, plan)
            if seq.pending_tokens:
                plan.append_tokens.extend((seq.seq_id, t) for t in seq.pending_tokens)
                seq.pending_tokens.clear()
            ids.append(seq.seq_id)
            nums.append(n)
            inflight.append((seq, n))  # type: ignore[union-attr]
            total += n
        budget.tokens -= total
        budget.seqs -= len(work)

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
                    self._pending_free.append(seq.seq_id)
                seq.forget_executor_state()
            return
        for seq in r.live:
            self._forget(seq)
            seq.num_computed_tokens = 0
        r.state = RequestState.WAITING
        self.waiting.appendleft(r)

    def _schedule_swapped(self, plan: BatchPlan, budget: _Budget) -> None:
        while self.swapped and budget.tokens > 0:
            r = self.swapped[0]
            pairs = self.kv.swap_in(r.live, reserve=self._watermark)
            if pairs is None:
                return
            self.swapped.popleft()
            plan.swap_in.extend(pairs)
            self._set_running(r)
            work = self._group_work(r, budget)
            if work:
                intros = self._intros(r)
                changes = self._allocate(work, self._watermark)
                if changes is not None:
                    self._emit(work, changes, intros, plan, budget)

    def _schedule_waiting(self, plan: BatchPlan, budget: _Budget) -> None:
        if not self.waiting:
            return
        cfg = self.config
        num_live = sum(_footprint(r) for r in self.running)
        while self.waiting and budget.tokens > 0:
            r = self.waiting[0]
            if num_live + _footprint(r) > cfg.max_num_seqs:
                return
            hit_tokens = self._take_prefix_hits(r)
            if hit_tokens is None:
                return
            work = self._group_work(r, budget)
            intros = self._intros(r) if work else []
            changes = self._allocate(work, self._watermark) if work else None
            if changes is None:
                self._unadmit(r)
                return
            self.waiting.popleft()
            self._set_running(r)
            self._emit(work, changes, intros, plan, budget)  # type: ignore[arg-type]
            self._count_prefix(r, hit_tokens)
            num_live += _footprint(r)

    def _take_prefix_hits(self, r: Request) -> list[int] | None:
        """Give each seq its cached prefix blocks (check-then-commit per seq)."""
        hits = []
        for seq in r.live:
            hit = self.kv.lookup_prefix(seq)
            if self.kv.allocate(seq, 0, hit) is None:
                self._unadmit(r)
                return None
            seq.num_computed_tokens = hit.num_tokens
            hits.append(hit.num_tokens)
        return hits

    def _unadmit(self, r: Request) -> None:
        """Undo a failed admission: hit blocks go back to the cache, nothing was sent."""
        for seq in r.live:
            self.kv.free(seq)
            seq.num_computed_tokens = 0
            seq.forget_executor_state()  # choices forked during the attempt get NewSeq later

    def _count_prefix(self, r: Request, hits: list[int]) -> None:
        for seq, h in zip(r.live[: len(hits)], hits, strict=True):  # choices forked at admission share the hit
            self.prefix_cache_query_tokens += seq.num_tokens
            self.prefix_cache_hit_tokens += h
        if r.emitted_seqs == 0 and not r.num_cached_prompt_tokens and hits:
            r.num_cached_prompt_tokens = min(hits[0], r.num_prompt_tokens)

    def _set_running(self, r: Request) -> None:
        r.state = RequestState.RUNNING
        if not self.running or self.running[-1].arrival < r.arrival:
            self.running.append(r)
        else:
            bisect.insort(self.running, r, key=lambda x: x.arrival)

    # ------------------------------------------------------------------ update
    def update(self, result: StepResult) -> list[RequestUpdate]:
        """Apply the executor's result of the plan in flight; returns per-request news."""
        if self._inflight is None:
            if result.step_id == self._stale_step:
                return []
            raise ValueError(f"update: no plan in flight (result for step {result.step_id})")
        if result.step_id != self._step_id:
            raise ValueError(f"update: result for step {result.step_id}, plan in flight is {self._step_id}")
        work, self._inflight = self._inflight, None
        if result.error is not None:
            return self._out.fail(work, result.error)
        self._advance(work)
        return self._out.process(result)

    def _advance(self, work: _Work) -> None:
        bs = self.config.block_size
        commit = self.kv.commit_computed
        for seq, n in work:
            if seq.finish_reason is not None:
                continue  # finished or aborted while the step ran
            old = seq.num_computed_tokens
            seq.num_computed_tokens = new = old + n
            if new // bs != old // bs:
                commit(seq)

    # ------------------------------------------------------------------ introspection
    def has_work(self) -> bool:
        return bool(self.requests or self._pending_free)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_swapped(self) -> int:
        return len(self.swapped)

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.kv.stats().get("used", self.kv.num_device_blocks - self.kv.num_free_blocks)

    @property
    def num_cached_blocks(self) -> int:
        return self.kv.stats().get("cached", 0)

    @property
    def num_shared_blocks(self) -> int:
        """O(num_blocks): for stats, not the hot path."""
        return self.kv.stats().get("shared", 0)

    @property
    def num_cpu_used_blocks(self) -> int:
        return self.kv.stats().get("cpu_used", 0)

    def block_stats(self) -> dict[str, int]:
        """used / cached / shared device blocks and cpu_used (stats; O(num_blocks))."""
        return self.kv.stats()

    def check_integrity(self) -> None:
        """RuntimeError unless queues, sequences and the KV pools agree."""
        self.kv.check_integrity()
        queued = {id(r) for q in (self.waiting, self.running, self.swapped) for r in q}
        if len(queued) != len(self.requests) or any(id(r) not in queued for r in self.requests.values()):
            raise RuntimeError("every request must sit in exactly one queue")
        if [r.arrival for r in self.running] != sorted(r.arrival for r in self.running):
            raise RuntimeError("running queue is not in arrival order")
        live = {s.seq_id for r in self.requests.values() for s in r.live}
        if live != set(self.seqs):
            raise RuntimeError("live sequence index disagrees with the requests")
        for r in self.waiting:
            for s in r.live:
                if s.resident or s.num_computed_tokens or self.kv.block_ids(s):
                    raise RuntimeError(f"waiting seq {s.seq_id} still holds executor state or blocks")


def _seeded(sp, i: int):
    """Choice i of a seeded n > 1 request samples with seed + i."""
    if i == 0 or sp.seed is None:
        return sp
    return dataclasses.replace(sp, seed=sp.seed + i)


def _footprint(r: Request) -> int:
    """Sequences a request may hold at once (beams and choices count before they exist)."""
    p = r.req.params
    return max(len(r.live), p.beam_width if r.beam is not None else (p.n if not r.forked else 1))
