"""The engine core: admit -> schedule -> send -> receive -> update -> hand the updates to their fronts.

One asyncio task per executor runs that loop against the executor's own :class:`Scheduler` (its
own KV pool). All scheduler state is mutated only by these loops, on the event loop thread,
between their awaits: fronts never touch it, they post additions, aborts and finished choices to a
slot's inbox and wake its loop. A slow executor only slows its own loop. With asynchronous
scheduling (the default) the loop keeps the executor's next plan queued behind the one it runs,
so the executor never waits for the core (docs/ARCHITECTURE.md).

The core does nothing per token that a request's size or text can stretch: it hands each step's
:class:`~scheduler_svc.request.RequestUpdate` (token ids, finish reasons, log-probs) to the front
that owns the request (an :class:`UpdateSink`), once the next plan is on its way. Detokenization,
stop strings and streaming happen in the fronts (``scheduler_svc/front_streams.py``), in this
process (``scheduler_svc/engine.py``) or in front processes of their own
(``scheduler_svc/tier/``).

When an executor dies (or its drain grace runs out) its requests are taken out of its scheduler
and re-queued elsewhere with the tokens already generated, so a client sees neither a gap nor a
repeat.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Collection
from typing import Protocol

from scheduler_svc.api_types import (
    EngineStats,
    ExecutorStats,
    FinishReason,
    GenerationRequest,
    ModelInfo,
    NoExecutor,
    QueueFull,
)
from scheduler_svc.engine_state import CoreRequest, ExecutorSlot
from scheduler_svc.executors import ExecutorConn, ExecutorHub, ExecutorLost
from scheduler_svc.kv_cache_manager import hash_blocks
from scheduler_svc.lifecycle import ProtocolError
from scheduler_svc.request import ERROR_FAILED, ERROR_NO_EXECUTOR, MigratedRequest, RequestUpdate
from scheduler_svc.routing import Router
from scheduler_svc.sched_config import EngineConfig
from scheduler_svc.scheduler import Scheduler

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.25  # an idle loop still wakes to notice drain deadlines
STATS_EVERY_S = 0.25  # how often gauges are refreshed from scheduler counters


class UpdateSink(Protocol):
    """Where the updates of one front's requests go: that front's streams, in this process or
    over the link to a front process. Called once per step with that front's share."""

    def deliver(self, updates: list[RequestUpdate]) -> None: ...


class EngineCore:
    def __init__(self, cfg: EngineConfig, eos_token_ids: Collection[int], metrics=None) -> None:
        self.cfg = cfg
        self.eos_token_ids = tuple(eos_token_ids)
        self.metrics = metrics  # the engine's gauges and counters (observe_stats, on_scheduled, ...)
        self.hub = ExecutorHub(cfg.executor_endpoint, block_size=cfg.scheduler.block_size,
                               heartbeat_interval_s=cfg.heartbeat_interval_s, on_join=self._on_join,
                               on_drain=self._on_drain, on_dead=self._on_dead, keys=cfg.executor_link,
                               step_timeout_s=cfg.step_timeout_s, model_fingerprint=cfg.model_fingerprint)
        self.slots: dict[str, ExecutorSlot] = {}
        self.router = Router()
        self.requests: dict[str, CoreRequest] = {}  # every request this core holds, by its id
        self.orphans: list[CoreRequest] = []  # waiting for an executor after a failure
        self._closing = False
        self._num_migrations = 0
        self._retired_preemptions = 0  # counters of schedulers of executors now gone
        self._retired_prefix = (0, 0)
        self._last_observed = 0.0
        self.num_steps = 0  # executor steps planned, all executors (benchmarks read it)
        self.on_readiness_change = lambda: None  # the servicer's health hook
        self.failure: str | None = None  # why an engine loop died unasked (liveness reports it)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.hub.start()

    async def stop(self) -> None:
        """Stop the loops and the executor transport (the fronts have ended their requests)."""
        self._closing = True
        for cr in list(self.requests.values()):
            self.abort(cr.request_id)
        for slot in self.slots.values():
            slot.wakeup.set()
        await asyncio.sleep(0.05)  # let loops send the frees
        for slot in list(self.slots.values()):
            if slot.task:
                slot.task.cancel()
        await asyncio.gather(*(s.task for s in self.slots.values() if s.task), return_exceptions=True)
        await self.hub.close()

    def begin_shutdown(self) -> None:
        """Stop admitting (readiness goes NOT_SERVING); running requests go on."""
        self._closing = True
        self.on_readiness_change()

    # ------------------------------------------------------------------ what fronts read

    def is_ready(self) -> bool:
        return not self._closing and any(s.conn.state == "ready" for s in self.slots.values())

    def health_problem(self) -> str | None:
        """Why this process cannot serve any more (liveness reports it), or None."""
        return self.hub.failure or self.failure

    def model_info(self) -> ModelInfo | None:
        """What requests may ask for: the most that some ready executor can hold (an executor
        with a shorter context or a smaller pool only narrows where a request can go)."""
        live = [s for s in self.slots.values() if s.conn.state != "dead"]
        if not live:
            return None
        ready = [s for s in live if s.conn.state == "ready"] or live
        info = live[0].conn.info
        return ModelInfo(model_name=info.model_name, architecture=info.architecture,
                         max_model_len=max(s.scheduler.config.max_model_len for s in ready),
                         vocab_size=info.vocab_size, block_size=self.cfg.scheduler.block_size,
                         num_executors=len(live), eos_token_ids=self.eos_token_ids,
                         max_request_blocks=max(s.scheduler.usable_blocks for s in ready))

    def stats(self) -> EngineStats:
        st = EngineStats(num_preemptions=self._retired_preemptions,
                         prefix_cache_query_tokens=self._retired_prefix[0],
                         prefix_cache_hit_tokens=self._retired_prefix[1],
                         num_migrations=self._num_migrations)
        st.num_waiting = len(self.orphans)
        for slot in self.slots.values():
            s = slot.scheduler
            st.num_running += s.num_running
            st.num_waiting += s.num_waiting + len(slot.adds)
            st.num_swapped += s.num_swapped
            st.num_preemptions += s.num_preemptions
            st.prefix_cache_query_tokens += s.prefix_cache_query_tokens
            st.prefix_cache_hit_tokens += s.prefix_cache_hit_tokens
            info = slot.conn.info
            blocks = s.block_stats()
            st.executors.append(ExecutorStats(
                id=slot.id, state=slot.conn.state, kv_blocks_total=info.num_device_blocks,
                kv_blocks_used=blocks["used"], kv_blocks_cached=blocks["cached"],
                kv_blocks_shared=blocks["shared"], cpu_blocks_total=info.num_cpu_blocks,
                cpu_blocks_used=blocks["cpu_used"], num_running=s.num_running,
                num_waiting=s.num_waiting + len(slot.adds), tensor_parallel_size=info.tensor_parallel_size))
        return st

    # ------------------------------------------------------------------ what fronts ask

    def submit(self, req: GenerationRequest, sink: UpdateSink) -> None:
        """Admit ``req`` (its id unique in this core); its updates go to ``sink``. QueueFull or
        NoExecutor (nothing kept) when it cannot be taken."""
        if self._closing:
            raise NoExecutor("the server is shutting down")
        if not self.is_ready():
            raise NoExecutor("no executor is connected; try again once one has registered")
        if self._num_queued() >= self.cfg.max_queued_requests:
            raise QueueFull(f"{self._num_queued()} requests are queued, the limit "
                            f"(max_queued_requests) is {self.cfg.max_queued_requests}")
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already running in this engine core")
        if not req.arrival_time:
            req.arrival_time = time.monotonic()
        cr = CoreRequest(req, sink)
        if (why := self._place(cr)) is not None:
            raise NoExecutor(why)
        self.requests[req.request_id] = cr

    def abort(self, request_id: str) -> None:
        """Its front ended it (client gone, deadline, shutdown, stop strings): free it (idempotent)."""
        cr = self.requests.pop(request_id, None)
        if cr is None:
            return
        cr.ended = True
        self._unpark(cr)
        slot = cr.slot
        if slot is not None:
            if cr in slot.adds:
                slot.remove_add(cr)
            elif slot.requests.pop(request_id, None) is not None:  # (what its last steps bring is dropped)
                slot.aborts.append(request_id)
                slot.wakeup.set()

    def finish_choice(self, request_id: str, index: int) -> None:
        """A stop string ended choice ``index`` (a front saw it in the text): the scheduler frees it."""
        cr = self.requests.get(request_id)
        if cr is not None and cr.slot is not None and request_id in cr.slot.requests:
            cr.slot.finished_choices.append((request_id, index))
            cr.slot.wakeup.set()

    def abort_owned_by(self, sink: UpdateSink) -> int:
        """A front went away: free every request it owned; how many there were."""
        gone = [rid for rid, cr in self.requests.items() if cr.sink is sink]
        for rid in gone:
            self.abort(rid)
        return len(gone)

    # ------------------------------------------------------------------ placement

    def _num_queued(self) -> int:
        return len(self.orphans) + sum(s.scheduler.num_waiting + len(s.adds) for s in self.slots.values())

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
        fits = [s for s in ready if s.scheduler.refusal(req, cr.resume) is None]
        if ready and not fits:
            return f"no connected executor can hold this request: {ready[0].scheduler.refusal(req, cr.resume)}"
        if req.prompt_block_hashes is None:  # (fronts hash prompts; a request from elsewhere is hashed here)
            req.prompt_block_hashes = hash_blocks(None, req.prompt_token_ids, self.cfg.scheduler.block_size)
        slot = self.router.choose(fits, req.prompt_block_hashes)
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
            if any(s.scheduler.refusal(req) is None for s in ready):
                return
        req.max_total_tokens = None  # fits nowhere: the caller reports why

    def _park(self, cr: CoreRequest) -> None:
        """No executor is ready: ``cr`` waits for one to register, for ``orphan_timeout_s`` at most."""
        self.orphans.append(cr)
        cr.parked = asyncio.get_running_loop().call_later(self.cfg.orphan_timeout_s, self._orphan_expired, cr)

    def _orphan_expired(self, cr: CoreRequest) -> None:
        if cr in self.orphans:
            self.orphans.remove(cr)
            self._fail(cr, ERROR_NO_EXECUTOR, f"its executor was lost and no executor registered within "
                                              f"{self.cfg.orphan_timeout_s:g}s (--orphan-timeout)")

    def _unpark(self, cr: CoreRequest) -> None:
        if cr.parked is not None:
            cr.parked.cancel()
            cr.parked = None
            if cr in self.orphans:
                self.orphans.remove(cr)

    def _place_or_fail(self, cr: CoreRequest) -> None:
        if (why := self._place(cr)) is not None:
            self._fail(cr, ERROR_NO_EXECUTOR, why)

    def _fail(self, cr: CoreRequest, kind: int, message: str) -> None:
        """End ``cr`` with an error its front turns into the client's status (``kind``)."""
        if cr.ended:
            return
        self.requests.pop(cr.request_id, None)
        cr.ended = True
        self._unpark(cr)
        cr.sink.deliver([RequestUpdate(cr.request_id, [], True, len(cr.req.prompt_token_ids), error=message,
                                       error_kind=kind)])

    # ------------------------------------------------------------------ executor events

    def _on_join(self, conn: ExecutorConn) -> None:
        info = conn.info
        if self.metrics:
            self.metrics.served_model = info.model_name
        cfg = dataclasses.replace(self.cfg.scheduler, max_model_len=info.max_model_len)
        slot = ExecutorSlot(conn, Scheduler(cfg, info.num_device_blocks, info.num_cpu_blocks,
                                            self.eos_token_ids, vocab_size=info.vocab_size))
        self.slots[conn.id] = slot
        slot.task = asyncio.create_task(self._run(slot), name=f"engine-{conn.id}")
        slot.task.add_done_callback(self._loop_ended)
        orphans, self.orphans = self.orphans, []
        for cr in orphans:
            self._unpark(cr)  # (already out of the list)
            self._place_or_fail(cr)
        self.on_readiness_change()

    def _on_drain(self, conn: ExecutorConn) -> None:
        slot = self.slots.get(conn.id)
        if slot is not None:
            slot.wakeup.set()
        self.on_readiness_change()

    def _on_dead(self, conn: ExecutorConn, why: str) -> None:
        slot = self.slots.get(conn.id)
        if slot is not None and slot.conn is conn:
            slot.wakeup.set()  # its loop sees the state, evacuates and exits
        self.on_readiness_change()

    # ------------------------------------------------------------------ the loop

    async def _run(self, slot: ExecutorSlot) -> None:
        """One executor's loop. Asynchronous (``depth`` 2): the executor always has its next
        plan queued; a result is applied, the next plan sent, and only then are the updates
        handed to the fronts. Synchronous (``depth`` 1): plan, wait, update, hand over, repeat."""
        sched, conn = slot.scheduler, slot.conn
        depth = 2 if self.cfg.async_scheduling else 1
        try:
            while conn.state != "dead":
                self._drain_inbox(slot)
                if conn.state == "draining" and time.monotonic() > (conn.drain_deadline or 0):
                    self._evacuate(slot, "drain grace period ended")
                while len(sched.in_flight) < depth and (plan := sched.schedule()) is not None:
                    self.num_steps += 1
                    if sched.first_scheduled:
                        self._observe_queue_times(sched)
                    await self.hub.send_plan(conn, plan, sched.in_flight[-1].max_result_bytes())
                if sched.failures:  # requests that failed alone while being scheduled
                    slot.unpublished += sched.failures
                    sched.failures = []
                if slot.unpublished:
                    self._flush(slot)
                if not sched.in_flight:
                    await self._idle(slot)
                    continue
                result = await self.hub.next_result(conn)
                if result.refused:
                    self._resync(slot, result)
                    continue
                # After failures, a step that served a live sequence ends the run of them (one behind a
                # failed step may have computed only what its executor had dropped).
                served = slot.failed_steps and any(sid in sched.seqs for sid in sched.in_flight[0].seq_ids)
                slot.unpublished += sched.update(result)
                if result.failed_seq_ids:
                    self._failed_step(slot, result)
                elif served:
                    slot.failed_steps = 0
                if depth == 1:
                    self._flush(slot)
                self._observe()
        except ExecutorLost:
            pass
        except ProtocolError as exc:  # the executor's fault: its requests move elsewhere
            log.warning("executor %s broke the protocol (%s); dropping it", slot.id, exc)
            self.hub.drop(conn, f"protocol error: {exc}")
        except asyncio.CancelledError:
            raise
        except Exception:
            # A bug, not an executor failure: fail this executor's requests (INTERNAL) rather
            # than replay them into the same bug elsewhere, and drop the connection so the
            # executor re-registers with a clean slate.
            log.exception("engine loop for executor %s failed; failing its requests", slot.id)
            self._flush(slot)
            for cr in list(slot.requests.values()) + slot.take_adds():
                self._fail(cr, ERROR_FAILED, "internal error in the scheduler")
            slot.requests = {}
            self.hub.drop(slot.conn, "engine loop failed")
        finally:
            if slot.conn.state == "dead" or not self._closing:
                self._evacuate(slot, "executor lost")  # (hands over what was applied first)
                self._retire(slot)
            else:
                self._flush(slot)  # shutdown: nothing moves, but what was applied is handed over

    async def _idle(self, slot: ExecutorSlot) -> None:
        slot.wakeup.clear()
        if slot.adds or slot.aborts or slot.finished_choices:
            return
        self._observe(force=True)  # gauges must not stay at the last busy step's values
        try:
            await asyncio.wait_for(slot.wakeup.wait(), IDLE_POLL_S)
        except TimeoutError:
            pass

    def _drain_inbox(self, slot: ExecutorSlot) -> None:
        aborts, slot.aborts = slot.aborts, []
        for rid in aborts:
            slot.scheduler.abort_request(rid)
            slot.requests.pop(rid, None)
        finished, slot.finished_choices = slot.finished_choices, []
        for rid, index in finished:
            self._finish_choice(slot, rid, index)
        for cr in slot.take_adds():
            try:
                slot.scheduler.add_request(cr.req, resume=cr.resume)
            except Exception:  # noqa: BLE001  (routing checked it fits: this is a bug, for cr only)
                log.exception("request %s could not be queued on executor %s", cr.request_id, slot.id)
                self._fail(cr, ERROR_FAILED, "could not queue the request")
                continue
            slot.requests[cr.request_id] = cr
            cr.resume = None

    def _finish_choice(self, slot: ExecutorSlot, rid: str, index: int) -> None:
        try:
            done = slot.scheduler.finish_sequence(rid, index, FinishReason.STOP)
        except ValueError:  # beam search choices end inside the scheduler only
            return
        if done and (cr := slot.requests.pop(rid, None)) is not None:
            self.requests.pop(rid, None)
            cr.ended = True  # (its front ended it: every choice stopped)

    def _flush(self, slot: ExecutorSlot) -> None:
        """Hand what ``slot``'s scheduler applied to the fronts that own it: after the next plan
        is sent, before its requests move (the new executor resumes after those tokens), and
        before the loop ends."""
        updates, slot.unpublished = slot.unpublished, []
        if not updates:
            return
        requests, by_sink = self.requests, {}
        for upd in updates:
            cr = requests.get(upd.request_id)
            if cr is None or cr.slot is not slot:
                continue  # ended meanwhile (aborted, or failed elsewhere)
            if upd.finished:
                del requests[upd.request_id]
                slot.requests.pop(upd.request_id, None)
                cr.ended = True
            batch = by_sink.get(id(cr.sink))
            if batch is None:
                by_sink[id(cr.sink)] = batch = (cr.sink, [])
            batch[1].append(upd)
        for sink, batch in by_sink.values():
            try:
                sink.deliver(batch)
            except Exception:  # noqa: BLE001  a front's failure is its own (its link drops it)
                log.exception("handing a step's updates to a front failed")

    # ------------------------------------------------------------------ failures

    def _resync(self, slot: ExecutorSlot, result) -> None:
        """The executor refused a plan: nothing of it was applied, and it refuses the plans behind it
        until told to reset, so the two views have parted. Its requests are taken back (the ones the
        refusal names fail) and placed again, here or elsewhere, resuming from the tokens they have,
        as after a migration; the executor forgets every sequence and serves on."""
        log.warning("executor %s refused plan %d (%s); resetting it and moving its requests",
                    slot.id, result.step_id, result.error)
        if result.failed_seq_ids:
            slot.unpublished += slot.scheduler.fail_seqs(result.failed_seq_ids,
                                                        "the executor refused this request's step")
        self.hub.reset(slot.conn, f"plan {result.step_id} was refused")
        self._evacuate(slot, f"plan {result.step_id} was refused")
        slot.scheduler.executor_reset()  # the reset covers their frees and discards their answers
        self._count_failure(slot, "refused a plan")

    def _failed_step(self, slot: ExecutorSlot, result) -> None:
        """The executor could not serve some sequences of a step (their requests have failed)."""
        whole = not result.sampled_seq_ids and not result.beam_candidates
        log.warning("executor %s failed %d sequences of step %d: %s", slot.id, len(result.failed_seq_ids),
                    result.step_id, result.error)
        if whole:
            self._count_failure(slot, "failed its step")
        else:
            slot.failed_steps = 0

    def _count_failure(self, slot: ExecutorSlot, what: str) -> None:
        slot.failed_steps += 1
        if slot.failed_steps >= self.cfg.max_failed_steps:
            self.hub.drop(slot.conn, f"{what} {slot.failed_steps} times in a row (--max-failed-steps)")

    def _loop_ended(self, task: asyncio.Task) -> None:
        """An executor's loop ended: fine once its executor is gone or at shutdown; otherwise the
        loop died of a bug its own handler could not catch, and liveness must say so."""
        if task.cancelled() or self._closing:
            return
        exc = task.exception()
        if exc is not None:
            self.failure = f"{task.get_name()} ended: {exc!r}"
            log.critical("engine loop failed: %s", self.failure, exc_info=exc)

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
                self._fail(cr, ERROR_NO_EXECUTOR, f"request moved {cr.migrations - 1} times after executor "
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

    def _retire(self, slot: ExecutorSlot) -> None:
        if self.slots.get(slot.id) is slot:  # (not a newer executor that registered under the same id)
            self.router.forget(slot.id)
            s = slot.scheduler
            self._retired_preemptions += s.num_preemptions
            q, h = self._retired_prefix
            self._retired_prefix = (q + s.prefix_cache_query_tokens, h + s.prefix_cache_hit_tokens)
            del self.slots[slot.id]

    # ------------------------------------------------------------------ observation

    def _observe_queue_times(self, sched: Scheduler) -> None:
        admitted, sched.first_scheduled = sched.first_scheduled, []
        if self.metrics:
            for req in admitted:
                self.metrics.on_scheduled(req.first_scheduled_at - req.arrival_time)

    def _observe(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.metrics and (force or now - self._last_observed > STATS_EVERY_S):
            self._last_observed = now
            self.metrics.observe_stats(self.stats())

