"""The engine: admit -> schedule -> send -> receive -> update -> stream out.

One asyncio task per executor runs that loop against the executor's own
:class:`Scheduler` (its own KV pool). All scheduler state is mutated only by
these loops, on the event loop thread, between their awaits: gRPC handlers
never touch it, they post additions and aborts to a slot's inbox and wake its
loop. A slow executor only slows its own loop. With asynchronous scheduling
(the default) the loop keeps the executor's next plan queued behind the one
it runs, so the executor never waits for the scheduler (docs/ARCHITECTURE.md).

When an executor dies (or its drain grace runs out) its requests are taken
out of its scheduler and re-queued elsewhere with the tokens already
streamed, so a client sees neither a gap nor a repeat.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import Collection

from tokenizers import Tokenizer

from scheduler_svc.api_types import (
    EngineStats,
    ExecutorStats,
    FinishReason,
    GenerationRequest,
    ModelInfo,
    NoExecutor,
    QueueFull,
    RequestFailed,
)
from scheduler_svc.detokenize import standalone_token_texts
from scheduler_svc.engine_state import ExecutorSlot, Tracked
from scheduler_svc.executors import ExecutorConn, ExecutorHub, ExecutorLost
from scheduler_svc.kv_cache_manager import hash_blocks
from scheduler_svc.lifecycle import ProtocolError
from scheduler_svc.output_stream import OutputStream
from scheduler_svc.outputs import RequestStream
from scheduler_svc.publish import Publisher, merge_updates
from scheduler_svc.request import MigratedRequest
from scheduler_svc.routing import Router
from scheduler_svc.sched_config import EngineConfig
from scheduler_svc.scheduler import Scheduler

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.25  # an idle loop still wakes to notice drain deadlines
STATS_EVERY_S = 0.25  # how often gauges are refreshed from scheduler counters


class Engine:
    def __init__(self, cfg: EngineConfig, tokenizer: Tokenizer, eos_token_ids: Collection[int],
                 metrics=None) -> None:
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        # Byte-level BPE spells each byte as one character, SentencePiece a piece as its characters:
        # either way no token covers more characters of a prompt than its longest entry has.
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=0)
        self.standalone_texts = standalone_token_texts(tokenizer)  # detokenization's table of most tokens
        self.metrics = metrics
        self.hub = ExecutorHub(cfg.executor_endpoint, block_size=cfg.scheduler.block_size,
                               heartbeat_interval_s=cfg.heartbeat_interval_s, on_join=self._on_join,
                               on_drain=self._on_drain, on_dead=self._on_dead, keys=cfg.executor_link,
                               step_timeout_s=cfg.step_timeout_s, model_fingerprint=cfg.model_fingerprint)
        self.slots: dict[str, ExecutorSlot] = {}
        self.router = Router()
        self.tracked: dict[str, Tracked] = {}
        self.orphans: list[Tracked] = []  # waiting for an executor after a failure
        self._closing = False
        self._num_migrations = 0
        self._retired_preemptions = 0  # counters of schedulers of executors now gone
        self._retired_prefix = (0, 0)
        self._last_observed = 0.0
        self.num_steps = 0  # executor steps planned, all executors (benchmarks read it)
        self.on_readiness_change = lambda: None  # the servicer's health hook
        self.failure: str | None = None  # why an engine loop died unasked (liveness reports it)
        self.publisher = Publisher(metrics, self.tracked, self._fail)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        await self.hub.start()

    async def shutdown(self, grace_s: float) -> None:
        """Stop admitting, let running requests finish for ``grace_s``, abort the rest."""
        self._closing = True
        self.on_readiness_change()
        deadline = time.monotonic() + grace_s
        while self.tracked and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for t in list(self.tracked.values()):
            self._abort(t, notify=True)
        for slot in self.slots.values():
            slot.wakeup.set()
        await asyncio.sleep(0.05)  # let loops send the frees
        for slot in list(self.slots.values()):
            if slot.task:
                slot.task.cancel()
        await asyncio.gather(*(s.task for s in self.slots.values() if s.task), return_exceptions=True)
        await self.hub.close()

    # ------------------------------------------------------------------ servicer API

    def is_ready(self) -> bool:
        return not self._closing and any(s.conn.state == "ready" for s in self.slots.values())

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
                         max_request_blocks=max(s.scheduler.usable_blocks for s in ready),
                         max_token_chars=self.max_token_chars)

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

    def generate(self, req: GenerationRequest) -> OutputStream:
        """``req``'s outputs, as an async iterator (admitted at its first ``__anext__``).

        Close it (``aclose()``) to stop early: the request is aborted and its blocks freed.
        """
        return OutputStream(req, self._admit, self._abandon)

    # ------------------------------------------------------------------ admission

    def _admit(self, req: GenerationRequest) -> Tracked:
        if self._closing:
            raise NoExecutor("the server is shutting down")
        if not self.is_ready():
            raise NoExecutor("no executor is connected; try again once one has registered")
        if self._num_queued() >= self.cfg.max_queued_requests:
            raise QueueFull(f"{self._num_queued()} requests are queued, the limit "
                            f"(max_queued_requests) is {self.cfg.max_queued_requests}")
        if not req.arrival_time:
            req.arrival_time = time.monotonic()
        if not req.request_id or req.request_id in self.tracked:
            req.request_id = req.request_id + "-" + uuid.uuid4().hex[:8] if req.request_id \
                else uuid.uuid4().hex
        p = req.params
        stream = RequestStream(req, self.tokenizer, num_choices=max(p.n, p.beam_width),
                               standalone_texts=self.standalone_texts)
        t = Tracked(stream, self.cfg.stream_interval)
        if (why := self._place(t)) is not None:
            raise NoExecutor(why)
        self.tracked[req.request_id] = t
        if self.metrics:
            self.metrics.on_admitted()
        return t

    def _abandon(self, t: Tracked) -> None:
        """Its consumer went away (stream closed or dropped, client gone, deadline passed)."""
        if not t.stream.done and t.request_id in self.tracked:
            self._abort(t, notify=False)

    def _num_queued(self) -> int:
        return len(self.orphans) + sum(s.scheduler.num_waiting + len(s.adds) for s in self.slots.values())

    def _place(self, t: Tracked) -> str | None:
        """Route ``t`` to a ready executor that can hold it (or park it until one registers).

        Returns why it cannot be placed when executors are ready and none can hold it: one
        executor's smaller pool or shorter context only narrows where a request may go. A request
        taken from another executor (``t.resume``) counts the tokens it generated there.
        """
        req = t.stream.req
        ready = [s for s in self.slots.values() if s.conn.state == "ready"]
        if req.max_total_tokens is None and ready:
            self._fix_length(req, ready)
        fits = [s for s in ready if s.scheduler.refusal(req, t.resume) is None]
        if ready and not fits:
            return f"no connected executor can hold this request: {ready[0].scheduler.refusal(req, t.resume)}"
        if req.prompt_block_hashes is None:  # hashed once: routing now, each scheduler's prefix lookup later
            req.prompt_block_hashes = hash_blocks(None, req.prompt_token_ids, self.cfg.scheduler.block_size)
        slot = self.router.choose(fits, req.prompt_block_hashes)
        if slot is None:
            self._park(t)
            return None
        t.slot = slot
        slot.add(t)
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

    def _park(self, t: Tracked) -> None:
        """No executor is ready: ``t`` waits for one to register, for ``orphan_timeout_s`` at most."""
        self.orphans.append(t)
        t.parked = asyncio.get_running_loop().call_later(self.cfg.orphan_timeout_s, self._orphan_expired, t)

    def _orphan_expired(self, t: Tracked) -> None:
        if t in self.orphans:
            self.orphans.remove(t)
            self._fail(t, NoExecutor(f"its executor was lost and no executor registered within "
                                     f"{self.cfg.orphan_timeout_s:g}s (--orphan-timeout)"))

    def _place_or_fail(self, t: Tracked) -> None:
        if (why := self._place(t)) is not None:
            self._fail(t, NoExecutor(why))

    def _abort(self, t: Tracked, notify: bool) -> None:
        if t.ended:
            return
        self.tracked.pop(t.request_id, None)
        self._unpark(t)
        slot = t.slot
        if slot is not None:
            if t in slot.adds:
                slot.remove_add(t)
            elif slot.requests.pop(t.request_id, None) is not None:  # (what its last steps bring is dropped)
                slot.aborts.append(t.request_id)
                slot.wakeup.set()
        t.ended = True
        out = t.stream.abort()
        if notify:
            t.put(out)
        if self.metrics:
            self.metrics.on_finish(FinishReason.ABORTED, time.monotonic() - t.stream.created,
                                   len(t.stream.req.prompt_token_ids),
                                   sum(len(v) for v in t.stream.outputs.values()))

    # ------------------------------------------------------------------ executor events

    def _on_join(self, conn: ExecutorConn) -> None:
        info = conn.info
        cfg = dataclasses.replace(self.cfg.scheduler, max_model_len=info.max_model_len)
        slot = ExecutorSlot(conn, Scheduler(cfg, info.num_device_blocks, info.num_cpu_blocks,
                                            self.eos_token_ids, vocab_size=info.vocab_size))
        self.slots[conn.id] = slot
        slot.task = asyncio.create_task(self._run(slot), name=f"engine-{conn.id}")
        slot.task.add_done_callback(self._loop_ended)
        orphans, self.orphans = self.orphans, []
        for t in orphans:
            self._unpark(t)  # (already out of the list)
            self._place_or_fail(t)
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
        plan queued; a result is applied, the next plan sent, and only then are the outputs
        streamed. Synchronous (``depth`` 1): plan, wait, update, stream, plan again."""
        sched, conn, pub = slot.scheduler, slot.conn, self.publisher
        depth = 2 if self.cfg.async_scheduling else 1

        def result_waiting() -> bool:  # the fan-out gives way to it
            return self.hub.result_ready(conn)

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
                    failed, sched.failures = sched.failures, []
                    pub.publish_now(slot, failed)
                if slot.unpublished:
                    updates, slot.unpublished = slot.unpublished, []
                    slot.unpublished = await pub.publish(slot, updates, result_waiting)
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
                updates = sched.update(result)
                if result.failed_seq_ids:
                    self._failed_step(slot, result)
                elif served:
                    slot.failed_steps = 0
                if depth == 1:
                    pub.publish_now(slot, updates)
                else:
                    slot.unpublished = merge_updates(slot.unpublished, pub.settle_stops(slot, updates))
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
            for t in list(slot.requests.values()) + slot.take_adds():
                self._fail(t, RequestFailed("internal error in the scheduler"))
            slot.requests = {}
            self.hub.drop(slot.conn, "engine loop failed")
        finally:
            if slot.conn.state == "dead" or not self._closing:
                self._evacuate(slot, "executor lost")  # (streams what was applied first)
                self._retire(slot)
            else:
                self._flush(slot)  # shutdown: nothing moves, but what was applied is streamed

    def _resync(self, slot: ExecutorSlot, result) -> None:
        """The executor refused a plan: nothing of it was applied, and it refuses the plans behind it
        until told to reset, so the two views have parted. Its requests are taken back (the ones the
        refusal names fail) and placed again, here or elsewhere, resuming from the tokens they have,
        as after a migration; the executor forgets every sequence and serves on."""
        log.warning("executor %s refused plan %d (%s); resetting it and moving its requests",
                    slot.id, result.step_id, result.error)
        self._flush(slot)
        if result.failed_seq_ids:
            self.publisher.publish_now(slot, slot.scheduler.fail_seqs(
                result.failed_seq_ids, "the executor refused this request's step"))
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

    def health_problem(self) -> str | None:
        """Why this process cannot serve any more (liveness reports it), or None."""
        return self.hub.failure or self.failure

    async def _idle(self, slot: ExecutorSlot) -> None:
        slot.wakeup.clear()
        if slot.adds or slot.aborts:
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
        for t in slot.take_adds():
            try:
                slot.scheduler.add_request(t.stream.req, resume=t.resume)
            except Exception as exc:  # noqa: BLE001  (routing checked it fits: this is a bug, for t only)
                log.exception("request %s could not be queued on executor %s", t.request_id, slot.id)
                self._fail(t, RequestFailed(f"could not queue the request: {exc}"))
                continue
            slot.requests[t.request_id] = t
            t.resume = None

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

    def _fail(self, t: Tracked, exc: Exception) -> None:
        """End ``t`` with ``exc`` (its consumer gets it after the outputs it has not read yet)."""
        if t.ended:
            return
        self.tracked.pop(t.request_id, None)
        self._unpark(t)
        t.stream.abort()
        t.put_error(exc)
        if self.metrics:
            self.metrics.on_failed()

    def _unpark(self, t: Tracked) -> None:
        if t.parked is not None:
            t.parked.cancel()
            t.parked = None
            if t in self.orphans:
                self.orphans.remove(t)

    def _flush(self, slot: ExecutorSlot) -> None:
        """Stream what ``slot``'s scheduler applied and did not stream yet: before its requests
        move (the new executor resumes after those tokens) or the loop ends."""
        if slot.unpublished:
            updates, slot.unpublished = slot.unpublished, []
            self.publisher.publish_now(slot, updates)

    def _evacuate(self, slot: ExecutorSlot, why: str) -> None:
        """Move every request of ``slot`` elsewhere (executor dead or drain over)."""
        self._flush(slot)
        moving = slot.take_adds() + [slot.requests[m.request.request_id]
                                     for m in self._take(slot) if m.request.request_id in slot.requests]
        slot.requests = {}
        for t in moving:
            if t.request_id not in self.tracked:
                continue
            t.migrations += 1
            if t.migrations > self.cfg.max_migrations:
                self._fail(t, NoExecutor(f"request moved {t.migrations - 1} times after executor "
                                         f"failures (max_migrations={self.cfg.max_migrations}); "
                                         f"last: {slot.id}: {why}"))
                continue
            self._num_migrations += 1
            t.slot = None
            self._place_or_fail(t)

    def _take(self, slot: ExecutorSlot) -> list[MigratedRequest]:
        try:
            taken = slot.scheduler.take_all_requests()
        except Exception:  # a broken scheduler must not stop the others' evacuation
            log.exception("could not take the requests of executor %s", slot.id)
            return []
        by_id = {m.request.request_id: m for m in taken}
        for rid, m in by_id.items():
            t = slot.requests.get(rid)
            if t is not None:
                t.resume = m
        return taken

    def _retire(self, slot: ExecutorSlot) -> None:
        if self.slots.get(slot.id) is slot:  # (not a newer executor that registered under the same id)
            self.router.forget(slot.id)
            s = slot.scheduler
            self._retired_preemptions += s.num_preemptions
            q, h = self._retired_prefix
            self._retired_prefix = (q + s.prefix_cache_query_tokens, h + s.prefix_cache_hit_tokens)
            del self.slots[slot.id]


__all__ = ["Engine", "EngineConfig"]
