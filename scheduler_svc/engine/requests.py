"""The requests an engine core holds: admission, where each runs, and moving them when an executor is lost.

:class:`CoreRequests` is the half of :class:`~scheduler_svc.engine.core.EngineCore` that deals in
requests rather than steps: what fronts ask (submit, abort, a stop string's finished choice, a
front gone), placement on a ready executor that can hold a request (prefix affinity bounded by
load, ``scheduler_svc/engine/router.py``; its reachable length fixed at its first placement), waiting for
an executor when none is left (``--orphan-timeout``), and migration (an executor dead, its drain
over, a plan refused: each request goes on elsewhere from the tokens it has, ``--max-migrations``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Protocol

from pagedserve.engine_api import EngineError, ErrorKind, FinishReason, GenerationRequest, RequestUpdate
from pagedserve.kv_blocks import chain_root, hash_blocks, lora_key
from scheduler_svc.engine.engine_config import EngineConfig
from scheduler_svc.engine.lora_registry import LoraRegistry
from scheduler_svc.engine.router import Router
from scheduler_svc.engine.state import CoreRequest, ExecutorSlot
from scheduler_svc.sched.request import MigratedRequest

log = logging.getLogger("scheduler_svc.engine.core")


class UpdateSink(Protocol):
    """Where the updates of one front's requests go: that front's streams, in this process or
    over the link to a front process. Called once per step with that front's share."""

    def deliver(self, updates: list[RequestUpdate]) -> None: ...


class CoreRequests:
    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.slots: dict[str, ExecutorSlot] = {}
        self.router = Router()
        # LoRA adapters served; every scheduler reads its paths (lora_key -> directory).
        self.lora = LoraRegistry(cfg.lora_modules, cfg.max_lora_rank)
        self.requests: dict[str, CoreRequest] = {}  # every request this core holds, by its id
        self.orphans: list[CoreRequest] = []  # waiting for an executor after a failure
        self._closing = False
        self._num_migrations = 0

    def is_ready(self) -> bool:
        return not self._closing and any(s.conn.state == "ready" for s in self.slots.values())

    # ------------------------------------------------------------------ what fronts ask

    def submit(self, req: GenerationRequest, sink: UpdateSink, resume: MigratedRequest | None = None) -> None:
        """Admit ``req`` (its id unique in this core); its updates go to ``sink``. EngineError
        (QUEUE_FULL or NO_EXECUTOR; nothing kept) when it cannot be taken. ``resume``: it ran on
        another engine core that was lost, and goes on from the tokens its front streamed."""
        if self._closing:
            raise EngineError(ErrorKind.NO_EXECUTOR, "the server is shutting down")
        if not self.is_ready():
            draining = sum(s.conn.state == "draining" for s in self.slots.values())
            raise EngineError(ErrorKind.NO_EXECUTOR, (
                f"the executors are all draining ({draining}: each finishes its requests, then leaves); try again "
                "once another has registered" if draining else
                "no executor is connected; try again once one has registered"))
        if self._num_queued() >= self.cfg.max_queued_requests:
            raise EngineError(ErrorKind.QUEUE_FULL, f"{self._num_queued()} requests are queued, the limit "
                                                    f"(max_queued_requests) is {self.cfg.max_queued_requests}")
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already running in this engine core")
        if req.lora:
            if req.lora not in self.lora.ids:
                raise EngineError(ErrorKind.NOT_FOUND, f"the LoRA adapter {req.lora[:200]!r} is not served here")
            req.lora_id = self.lora.ids[req.lora]
            if req.lora_id:  # (a front hashes with the name alone: this load's chain is its own)
                req.prompt_block_hashes = None
        if not req.arrival_time:
            req.arrival_time = time.monotonic()
        cr = CoreRequest(req, sink, resume=resume)
        if (why := self._place(cr)) is not None:
            raise EngineError(ErrorKind.NO_EXECUTOR, why)
        self.requests[req.request_id] = cr
        if req.deadline is not None:  # (a front cancels at its client's deadline too; a stuck one would not)
            cr.expiry = asyncio.get_running_loop().call_later(max(0.0, req.deadline - time.monotonic()),
                                                              self._deadline_passed, cr)

    def abort(self, request_id: str) -> None:
        """Its front ended it (client gone, deadline, shutdown, stop strings): free it (idempotent)."""
        cr = self.requests.pop(request_id, None)
        if cr is None:
            return
        cr.end()
        if cr.parked is not None:  # (waiting for an executor: perhaps no loop is left to refresh the gauges)
            self._unpark(cr)
            self._observe(force=True)
        slot = cr.slot
        if slot is not None:
            if cr in slot.adds:
                slot.remove_add(cr)
            elif slot.requests.pop(request_id, None) is not None:  # (what its last steps bring is dropped)
                slot.aborts.append(request_id)
                slot.wakeup.set()

    def _deadline_passed(self, cr: CoreRequest) -> None:
        cr.expiry = None
        if cr.ended:
            return
        waited = time.monotonic() - cr.req.arrival_time
        self.abort(cr.request_id)  # (its blocks are freed as an aborted request's are)
        _tell_error(cr, ErrorKind.DEADLINE, f"its deadline passed {waited:.1f}s after it arrived")

    def finish_choice(self, request_id: str, index: int) -> None:
        """A stop string ended choice ``index`` (a front saw it in the text): the scheduler frees it.

        A request moving to another executor (queued there, or waiting for one) has no scheduler:
        the choice is marked finished in what it resumes from, so that it is not computed on to
        max_tokens there (its front drops those tokens, and ends the stream without an abort when
        the other choices end)."""
        cr = self.requests.get(request_id)
        if cr is None:
            return
        if cr.slot is not None and request_id in cr.slot.requests:
            cr.slot.finished_choices.append((request_id, index))
            cr.slot.wakeup.set()
        elif cr.resume is not None and 0 <= index < len(cr.resume.finish_reasons):
            reasons = cr.resume.finish_reasons
            reasons[index] = reasons[index] or FinishReason.STOP
            if all(reasons):  # (nothing left to resume: it ends here)
                self.abort(request_id)

    def abort_owned_by(self, sink: UpdateSink) -> int:
        """A front went away: free every request it owned; how many there were."""
        gone = [rid for rid, cr in self.requests.items() if cr.sink is sink]
        for rid in gone:
            self.abort(rid)
        return len(gone)

    # ------------------------------------------------------------------ placement

    def _num_queued(self) -> int:
        """Requests waiting for a seat (what ``max_queued_requests`` bounds): those no executor has,
        and on each executor those admitted beyond its free seats (``max_num_seqs`` less its running
        and swapped requests). A burst that free seats will take at the next step is not a queue."""
        return len(self.orphans) + sum(_beyond_seats(s) for s in self.slots.values())

    def _place(self, cr: CoreRequest) -> str | None:
        """Route ``cr`` to a ready executor that can hold it (or park it until one registers).

        Returns why it cannot be placed when executors are ready and none can hold it: one
        executor's smaller pool or shorter context only narrows where a request may go. A request
        taken from another executor (``cr.resume``) counts the tokens it generated there.
        """
        req = cr.req
        ready = [s for s in self.slots.values() if s.conn.state == "ready"]
        if req.max_total_tokens is None and ready:
            self._fix_length(req, ready)
        fits = [s for s in ready if s.scheduler.why_cannot_hold(req, cr.resume) is None]
        if ready and not fits:
            why = ready[0].scheduler.why_cannot_hold(req, cr.resume)
            return f"no connected executor can hold this request: {why}"
        if req.prompt_block_hashes is None:  # (fronts hash prompts; a request from elsewhere is hashed here)
            root = chain_root(req.lora, req.lora_id, req.cache_salt)
            req.prompt_block_hashes = hash_blocks(root, req.prompt_token_ids, self.cfg.scheduler.block_size)
        slot = self.router.choose(fits, req.prompt_block_hashes, lora_key(req.lora, req.lora_id))
        if slot is None:
            self._park(cr)
            return None
        cr.slot = slot
        slot.add(cr)
        slot.wakeup.set()
        return None

    @staticmethod
    def _fix_length(req: GenerationRequest, ready: list[ExecutorSlot]) -> None:
        """Fix the most tokens ``req`` may reach, once: the longest context it fits in among the ready
        executors, so that a later migration never changes where it ends."""
        want = len(req.prompt_token_ids) + req.params.max_tokens
        for length in sorted({min(want, s.scheduler.config.max_model_len) for s in ready}, reverse=True):
            req.max_total_tokens = length
            if any(s.scheduler.why_cannot_hold(req) is None for s in ready):
                return
        req.max_total_tokens = None  # fits nowhere: the caller reports why

    def _park(self, cr: CoreRequest) -> None:
        """No executor is ready: ``cr`` waits for one to register, for ``orphan_timeout_s`` at most."""
        self.orphans.append(cr)
        cr.parked = asyncio.get_running_loop().call_later(self.cfg.orphan_timeout_s, self._orphan_expired, cr)

    def _orphan_expired(self, cr: CoreRequest) -> None:
        if cr in self.orphans:
            self.orphans.remove(cr)
            self._fail(cr, ErrorKind.NO_EXECUTOR, f"its executor was lost and no executor registered within "
                                                  f"{self.cfg.orphan_timeout_s:g}s (--orphan-timeout)")
            self._observe(force=True)

    def _observe(self, force: bool = False) -> None:
        """Refresh the gauges from the queues (the engine core's, which has metrics). Every executor's
        loop does it as it goes; what changes the queues while no loop may be left (an executor
        gone, a request that waited for one failed or aborted) calls it too."""

    def _unpark(self, cr: CoreRequest) -> None:
        if cr.parked is not None:
            cr.parked.cancel()
            cr.parked = None
            if cr in self.orphans:
                self.orphans.remove(cr)

    def _place_or_fail(self, cr: CoreRequest) -> None:
        if (why := self._place(cr)) is not None:
            self._fail(cr, ErrorKind.NO_EXECUTOR, why)

    def _fail(self, cr: CoreRequest, kind: ErrorKind, message: str) -> None:
        """End ``cr`` with an error: ``kind`` reaches its client's status as it is."""
        if cr.ended:
            return
        self.requests.pop(cr.request_id, None)
        cr.end()
        self._unpark(cr)
        _tell_error(cr, kind, message)

    def _evacuate(self, slot: ExecutorSlot, why: str) -> None:
        """Move every request of ``slot`` elsewhere (executor dead, drain over, plan refused)."""
        self._flush(slot)
        moving = slot.take_adds() + [slot.requests[m.request.request_id]
                                     for m in self._take(slot) if m.request.request_id in slot.requests]
        slot.requests = {}
        for cr in moving:
            if cr.ended:
                continue
            cr.migrations += 1
            if cr.migrations > self.cfg.max_migrations:
                self._fail(cr, ErrorKind.NO_EXECUTOR, f"request moved {cr.migrations - 1} times after executor "
                                                  f"failures (max_migrations={self.cfg.max_migrations}); "
                                                  f"last: {slot.id}: {why}")
                continue
            self._num_migrations += 1
            cr.slot = None
            self._place_or_fail(cr)

    def _take(self, slot: ExecutorSlot) -> list[MigratedRequest]:
        try:
            taken = slot.scheduler.take_all_requests()
        except Exception:  # a broken scheduler must not stop the others' evacuation
            log.exception("could not take the requests of executor %s", slot.id)
            return []
        for m in taken:
            cr = slot.requests.get(m.request.request_id)
            if cr is not None:
                cr.resume = m
        return taken


def _beyond_seats(slot: ExecutorSlot) -> int:
    sched = slot.scheduler
    pending = sched.num_waiting + len(slot.adds)
    free = sched.config.max_num_seqs - sched.num_running - sched.num_swapped
    return max(0, pending - max(0, free))


def _tell_error(cr: CoreRequest, kind: ErrorKind, message: str) -> None:
    """The last update of ``cr``, an error: ``kind`` reaches its client's status as it is."""
    cr.sink.deliver([RequestUpdate(cr.request_id, [], True, len(cr.req.prompt_token_ids), error=message,
                                   error_kind=kind)])
