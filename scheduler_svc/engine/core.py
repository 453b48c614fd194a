"""The engine core: admit -> schedule -> send -> receive -> update -> hand the updates to their fronts.

One asyncio task per executor runs that loop against the executor's own :class:`Scheduler` (its
own KV pool). All scheduler state is mutated only by these loops, on the event loop thread,
between their awaits: fronts never touch it, they post additions, aborts and finished choices to a
slot's inbox and wake its loop. A slow executor only slows its own loop. With asynchronous
scheduling (the default) the loop keeps the executor's next plan queued behind the one it runs,
so the executor never waits for the core (docs/ARCHITECTURE.md).

The core does nothing per token that a request's size or text can stretch: it hands each step's
:class:`~scheduler_svc.sched.request.RequestUpdate` (token ids, finish reasons, log-probs) to the front
that owns the request (an :class:`UpdateSink`), once the next plan is on its way. Detokenization,
stop strings and streaming happen in the fronts (``scheduler_svc/front/streams.py``), in this
process (``testing/in_process_engine.py``) or in front processes of their own
(``scheduler_svc/front/core_link.py, scheduler_svc/engine/front_link.py``).

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
from pathlib import Path

from pagedserve.draft_model import draft_name
from pagedserve.engine_api import (
    EngineStats,
    ErrorKind,
    ExecutorStats,
    FinishReason,
    ModelInfo,
)
from scheduler_svc.engine.engine_config import EngineConfig
from scheduler_svc.engine.executor_conn import ExecutorConn
from scheduler_svc.engine.executor_link import ExecutorHub, ExecutorLost
from scheduler_svc.engine.requests import CoreRequests
from scheduler_svc.engine.state import ExecutorSlot, SchedulerCounters
from scheduler_svc.sched.in_flight import ProtocolError
from scheduler_svc.sched.scheduler import Scheduler

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.25  # an idle loop still wakes to notice drain deadlines
STATS_EVERY_S = 0.25  # how often gauges are refreshed from scheduler counters


class EngineCore(CoreRequests):
    def __init__(self, cfg: EngineConfig, eos_token_ids: Collection[int], metrics=None) -> None:
        super().__init__(cfg)
        self.eos_token_ids = tuple(eos_token_ids)
        self.metrics = metrics  # the engine's gauges and counters (observe_stats, on_scheduled, ...)
        self.hub = ExecutorHub(cfg.executor_endpoint, block_size=cfg.scheduler.block_size,
                               heartbeat_interval_s=cfg.heartbeat_interval_s, on_join=self._on_join,
                               on_drain=self._on_drain, on_dead=self._on_dead, keys=cfg.executor_link,
                               step_timeout_s=cfg.step_timeout_s, model_fingerprint=cfg.model_fingerprint,
                               batch_invariant=cfg.batch_invariant)
        spec = cfg.scheduler.speculative
        draft = draft_name(Path(spec.model)) if spec is not None and spec.model is not None else None
        self.hub.admission.draft_model = draft
        self.hub.admission.max_lora_rank = cfg.max_lora_rank if cfg.enable_lora else None
        self._retired = SchedulerCounters()  # the counters of schedulers of executors now gone
        self._last_observed = 0.0
        self.num_steps = 0  # executor steps planned, all executors (benchmarks read it)
        self.on_readiness_change = lambda: None  # the servicer's health hook
        self.failure: str | None = None  # why an engine loop died unasked (liveness reports it)
        # The whole deployment's stats, for the vllm: gauges: this core's, or (the first of several
        # engine cores) every core's.
        self.deployment_stats = self.stats

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
        return ModelInfo(model_name=self.cfg.served_model_name or info.model_name, architecture=info.architecture,
                         max_model_len=max(s.scheduler.config.max_model_len for s in ready),
                         vocab_size=info.vocab_size, block_size=self.cfg.scheduler.block_size,
                         num_executors=len(live), eos_token_ids=self.eos_token_ids,
                         max_request_blocks=max(s.scheduler.usable_blocks for s in ready),
                         lora_adapters=self.lora.names)

    def stats(self) -> EngineStats:
        st = EngineStats(num_migrations=self._num_migrations)
        counted = self._retired.copy()
        st.num_waiting = len(self.orphans)
        for slot in self.slots.values():
            s = slot.scheduler
            st.num_running += s.num_running
            st.num_waiting += s.num_waiting + len(slot.adds)
            st.num_swapped += s.num_swapped
            counted.add(s)
            info = slot.conn.info
            blocks = s.block_stats()
            st.executors.append(ExecutorStats(
                id=slot.id, state=slot.conn.state, kv_blocks_total=info.num_device_blocks,
                kv_blocks_used=blocks["used"], kv_blocks_cached=blocks["cached"],
                kv_blocks_shared=blocks["shared"], cpu_blocks_total=info.num_cpu_blocks,
                cpu_blocks_used=blocks["cpu_used"], num_running=s.num_running,
                num_waiting=s.num_waiting + len(slot.adds), tensor_parallel_size=info.tensor_parallel_size))
        counted.report(st)
        self._lora_stats(st)
        return st

    def _lora_stats(self, st: EngineStats) -> None:
        if not self.cfg.enable_lora:  # (stats are read every heartbeat: no walk over the queues for nothing)
            return
        running, waiting = set(), {cr.req.lora for cr in self.orphans if cr.req.lora}
        for slot in self.slots.values():
            s = slot.scheduler
            running |= {r.req.lora for q in (s.running, s.swapped) for r in q if r.req.lora}
            waiting |= {r.req.lora for r in s.waiting if r.req.lora} | {cr.req.lora for cr in slot.adds if cr.req.lora}
            st.max_lora = max(st.max_lora, s.lora.num_slots)
        st.lora_running, st.lora_waiting = sorted(running), sorted(waiting)

    # ------------------------------------------------------------------ executor events

    def _on_join(self, conn: ExecutorConn) -> None:
        info = conn.info
        if self.metrics:
            self.metrics.watch_deployment(self.cfg.served_model_name or info.model_name,
                                          lambda: self.deployment_stats())
        cfg = dataclasses.replace(self.cfg.scheduler, max_model_len=info.max_model_len,
                                  decode_steps=info.max_decode_steps,
                                  speculative=self.cfg.scheduler.speculative if info.speculative else None,
                                  lora_slots=min(self.cfg.max_loras, info.lora_slots) if self.cfg.enable_lora else 0)
        slot = ExecutorSlot(conn, Scheduler(cfg, info.num_device_blocks, info.num_cpu_blocks,
                                            self.eos_token_ids, vocab_size=info.vocab_size,
                                            lora_paths=self.lora.paths))
        if (displaced := self.slots.get(conn.id)) is not None:  # (its process restarted: the old loop ends later)
            self._retired.add(displaced.scheduler)
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
                self._fail(cr, ErrorKind.FAILED, "internal error in the scheduler")
            slot.requests = {}
            self.hub.drop(slot.conn, "engine loop failed")
        finally:
            if slot.conn.state == "dead" or not self._closing:
                self._evacuate(slot, "executor lost")  # (hands over what was applied first)
                self._retire(slot)
                self._observe(force=True)  # (its requests and blocks left the gauges: no loop may be left to say so)
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
                self._fail(cr, ErrorKind.FAILED, "could not queue the request")
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
            cr.end()  # (its front ended it: every choice stopped)

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
                cr.end()
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
        """The executor could not serve some sequences of a step (their requests have failed). A step
        that served none counts against the executor, unless every sequence it failed was rejected for
        what its own request asked (a client's bad grammar must not take an executor down)."""
        log.warning("executor %s failed %d sequences of step %d (%d rejected for their request): %s", slot.id,
                    len(result.failed_seq_ids), result.step_id, len(result.rejected), result.error)
        if set(result.failed_seq_ids) <= {r.seq_id for r in result.rejected}:
            return  # the requests' fault alone: neither a failure of the executor's nor a step it served
        if not result.sampled_seq_ids and not result.beam_candidates:
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

    def _retire(self, slot: ExecutorSlot) -> None:
        if self.slots.get(slot.id) is slot:  # (not a newer executor that registered under the same id)
            self.router.forget(slot.id)
            self._retired.add(slot.scheduler)  # (a counter never goes back)
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


