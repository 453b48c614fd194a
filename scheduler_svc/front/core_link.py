"""A front process's link to its engine core: the ``CoreApi`` of its streams, over ZeroMQ.

:class:`RemoteCore` dials the core's front link (a DEALER), says ``FrontHello`` and keeps the
core's last ``Status``: readiness, model info, stats and health, which is all a front reads of
the core between requests. ``submit``, ``abort`` and ``finish_choice`` are messages; the core's
``Updates`` go to the front's streams (``FrontStreams.deliver``), a request not admitted among them
as an error update. Every second the front's own counters go to the core, which serves the whole
deployment's /metrics.

A core silent for ``DEAD_AFTER_INTERVALS`` heartbeats is lost: the front is not ready, every
request it had there fails with ``NO_EXECUTOR`` (UNAVAILABLE), and it keeps dialling; once the
core answers again, it is ready again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
import traceback
from collections.abc import Callable

import zmq

from pagedserve.engine_api import EngineError, EngineStats, ErrorKind, GenerationRequest, ModelInfo
from pagedserve.ratelog import RateLimitedLog
from pagedserve.wire import DEAD_AFTER_INTERVALS, WireError
from pagedserve.wire import front_messages as m
from pagedserve.wire.keys import ClientKeys, make_client
from pagedserve.wire.router_socket import RouterSocket

log = logging.getLogger(__name__)
core_warning = RateLimitedLog(log)
METRICS_EVERY_S = 1.0


class RemoteCore:
    def __init__(self, endpoint: str, front_id: str, keys: ClientKeys | None = None,
                 front_families: Callable[[], list] | None = None) -> None:
        self.endpoint, self.front_id, self.keys = endpoint, front_id, keys
        self.id = endpoint  # (its name among a front's cores)
        self.front_families = front_families  # this front's metrics (FrontMetrics; None: sent to another core)
        self.streams = None  # where the core's updates go (attach(): a CoreSet, or FrontStreams)
        self.status: m.Status | None = None
        self.connected = False  # the core answered our hello and has not gone silent since
        self.incarnation = 0  # its process's (CoreHello): another after it restarted
        self.on_status_change: Callable[[], None] = lambda: None  # the servicer's health hook
        self._ctx = zmq.Context.instance()
        self._sock: RouterSocket | None = None
        self._receiver: asyncio.Task | None = None
        self._last_heard = 0.0
        self._queries = itertools.count(1)
        self._answers: dict[int, asyncio.Future] = {}
        self._tasks: list[asyncio.Task] = []

    def attach(self, streams) -> None:
        self.streams = streams

    # ------------------------------------------------------------------ what the front reads

    def model_info(self) -> ModelInfo | None:
        return self.status.model_info if self.connected and self.status else None

    def is_ready(self) -> bool:
        return self.connected and self.status is not None and self.status.ready

    def stats(self) -> EngineStats:
        return self.status.stats if self.status else EngineStats()

    def health_problem(self) -> str | None:
        return self.status.health_problem if self.status else None

    async def metrics_text(self, timeout_s: float = 5.0) -> str:
        """The deployment's metrics as the core exposes them (Prometheus text)."""
        return (await self._ask(m.QUERY_METRICS, timeout_s)).text or ""

    async def current_stats(self, timeout_s: float = 5.0) -> EngineStats:
        """The core's stats now (its Status is up to a heartbeat old)."""
        answer = await self._ask(m.QUERY_STATS, timeout_s)
        return answer.stats if answer.stats is not None else self.stats()

    async def families(self, timeout_s: float = 5.0) -> list:
        """The core's own metrics (another engine core sums them)."""
        return (await self._ask(m.QUERY_FAMILIES, timeout_s)).families or []

    async def update_lora(self, name: str, path: str | None, timeout_s: float = 30.0) -> m.Answer:
        """Load (``path``) or unload (None) a LoRA adapter on the core; its Answer says if not done."""
        return await self._ask(None, timeout_s, lambda qid: m.LoraUpdate(qid, name, path))

    async def _ask(self, what: int | None, timeout_s: float, make=None) -> m.Answer:
        qid = next(self._queries)
        fut = self._answers[qid] = asyncio.get_running_loop().create_future()
        try:
            self._send(m.Query(qid, what) if make is None else make(qid))
            return await asyncio.wait_for(fut, timeout_s)
        finally:
            self._answers.pop(qid, None)

    # ------------------------------------------------------------------ what the front asks

    def submit(self, req: GenerationRequest, sink, resume: tuple[list, list] | None = None) -> None:
        """Send ``req`` (``resume``: the outputs and finish reasons it had on a core that was lost)."""
        if not self.is_ready():
            raise EngineError(ErrorKind.NO_EXECUTOR, "the engine core is not reachable; try again")
        now = time.monotonic()
        queued = max(0.0, now - req.arrival_time) if req.arrival_time else 0.0
        # (a client's deadline may be 3.6e11 s away, grpc-timeout 99999999H: past the link's bound the
        # core would refuse the frame and drop this front, every request it holds with it)
        deadline_in = None if req.deadline is None else min(max(0.0, req.deadline - now), m.MAX_SECONDS)
        outputs, finished = resume if resume is not None else (None, [])
        packed = m.pack_ids(req.prompt_token_ids, "prompt_token_ids")  # (validated ids: in the vocabulary)
        self._send(m.Submit(dataclasses.replace(req, prompt_token_ids=[], arrival_time=0.0, deadline=None), packed,
                            queued, deadline_in, outputs, finished))

    def abort(self, request_id: str) -> None:
        self._send(m.Abort(request_id))

    def finish_choice(self, request_id: str, index: int) -> None:
        self._send(m.FinishChoice(request_id, index))

    # ------------------------------------------------------------------ the link

    async def start(self) -> None:
        self._connect()
        self._tasks = [asyncio.create_task(self._heartbeat_loop(), name="core-link-heartbeat")]

    async def close(self) -> None:
        for t in [*self._tasks, self._receiver]:
            if t is not None:
                t.cancel()
        await asyncio.gather(*(t for t in [*self._tasks, self._receiver] if t is not None), return_exceptions=True)
        if self._sock is not None:
            self._sock.close()

    def _connect(self) -> None:
        """A new connection (a new socket: ZeroMQ would queue our messages for the old peer)."""
        if self._receiver is not None:
            self._receiver.cancel()
        if self._sock is not None:
            self._sock.close()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_FRAME_BYTES)
        sock.setsockopt(zmq.SNDHWM, 0)  # (the core reads as fast as it schedules; a step's sends must not drop)
        if self.keys is not None:
            make_client(sock, self.keys)
        sock.connect(self.endpoint)
        self._sock = RouterSocket(sock, asyncio.get_running_loop())
        self._last_heard = time.monotonic()
        self._send(m.FrontHello(self.front_id, m.TIER_VERSION, m.INCARNATION))
        self._receiver = asyncio.get_running_loop().create_task(self._recv_loop(self._sock), name="core-link-recv")

    def _send(self, msg: m.Message) -> None:
        try:
            self._sock.send_multipart([m.TIER.encode(msg)])
        except zmq.ZMQError as exc:
            core_warning("could not send a %s to the engine core: %s", type(msg).__name__, exc)

    async def _recv_loop(self, sock: RouterSocket) -> None:
        while True:
            frames = await sock.recv_multipart()
            try:
                msg = m.TIER.decode(frames[-1], accept=m.FROM_CORE, max_bytes=m.MAX_FRAME_BYTES)
            except WireError as exc:
                core_warning("dropping a malformed frame from the engine core: %s", exc)
                continue
            self._last_heard = time.monotonic()
            try:
                self._dispatch(msg)
            except Exception as exc:  # noqa: BLE001  a bug here must not end the link
                core_warning("error while handling the engine core's %s: %s", type(msg).__name__,
                             "".join(traceback.format_exception(exc)))

    def _dispatch(self, msg: m.Message) -> None:
        if isinstance(msg, m.Updates):
            self.streams.deliver(msg.updates)
        elif isinstance(msg, m.Status):
            changed = self.status is None or self.status.ready != msg.ready or not self.connected
            self.status, self.connected = msg, True
            self.streams.status_changed(self)
            if changed:
                self.on_status_change()
        elif isinstance(msg, m.Answer):
            fut = self._answers.get(msg.query_id)
            if fut is not None and not fut.done():
                fut.set_result(msg)
        elif isinstance(msg, m.CoreHello):
            if msg.accepted:
                self.incarnation = msg.incarnation
            else:
                log.error("the engine core refused this front: %s", msg.reason)

    async def _heartbeat_loop(self) -> None:
        limit = DEAD_AFTER_INTERVALS * m.HEARTBEAT_INTERVAL_S
        last_metrics = 0.0
        while True:
            await asyncio.sleep(m.HEARTBEAT_INTERVAL_S)
            now = time.monotonic()
            if now - self._last_heard > limit:
                self._lost(f"silent for {now - self._last_heard:.1f}s")
                continue
            self._send(m.Heartbeat(time.time()))
            if self.front_families is not None and now - last_metrics >= METRICS_EVERY_S:
                last_metrics = now
                self._send(m.FrontMetrics(self.front_families()))

    def _lost(self, why: str) -> None:
        """The core is gone: what ran there fails (UNAVAILABLE), and we dial it again."""
        was = self.connected
        self.connected = False
        if was:
            log.warning("lost the engine core (%s); moving its requests to another core (or failing them) and "
                        "dialling again", why)
            try:
                if self.streams is not None:
                    self.streams.core_lost(self, EngineError(ErrorKind.NO_EXECUTOR, f"the engine core was lost ({why})"))
                self.on_status_change()
            except Exception:  # noqa: BLE001  a bug here must not stop the redial (nor this heartbeat loop)
                log.exception("moving the requests of a lost engine core failed")
        self._connect()
