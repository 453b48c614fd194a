"""An engine core's link to its fronts: their requests in, each step's updates out, on one ROUTER.

Each front dials in (a DEALER), says ``FrontHello`` and is answered ``CoreHello``; from then on
its ``Submit``, ``Abort`` and ``FinishChoice`` go to the core (``EngineCore.submit`` and so on)
and the core hands each step's updates of its requests back through :class:`RemoteFront`, its
``UpdateSink``: one ``Updates`` message per front per step. ``Status`` goes to every front each
heartbeat and whenever readiness changes; it is also the core's heartbeat.

Trust: the link is local (an ``ipc://`` socket in a directory only the scheduler's user can
enter) or CURVE-authenticated (fronts of their own Deployment, with keys the core admits, as
executors). What a front sends is decoded with the bounded codec; a front's malformed frame (one
past the link's bounds too), or one naming a request it did not submit, drops that front. A request
that decodes but breaks the core's own limits (submit_bounds.py) fails alone, INVALID. A front silent for
``DEAD_AFTER_INTERVALS`` heartbeats is dead: its requests are aborted and their blocks freed.

A ``Submit``'s prompt comes packed (``messages.PackedIds``): one longer than the longest context (too
large for any executor) fails before any of it is unpacked, and a long one is turned into ints
``UNPACK_SLICE`` ids at a time, the loop free between slices, so no plan waits for it. The link
reads on only when a Submit is admitted, so what a front sends is handled in the order it was sent.
"""

from __future__ import annotations

import asyncio
import logging
import time
import traceback
from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import zmq

from pagedserve.engine_api import (
    EngineError,
    ErrorKind,
    FinishReason,
    RequestUpdate,
)
from pagedserve.lora_modules import LoraConfigError, inspect_adapter
from pagedserve.ratelog import RateLimitedLog
from pagedserve.request_bounds import RequestLimits, ValidationError, check_token_ids
from pagedserve.wire import DEAD_AFTER_INTERVALS, MAX_HANDSHAKE_FRAME_BYTES, WireError
from pagedserve.wire import front_messages as m
from pagedserve.wire.keys import KeyPair, make_server
from pagedserve.wire.router_socket import RouterSocket
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.front_keys import FLAG, ZAP_DOMAIN, FrontKeys
from scheduler_svc.engine.submit_bounds import check_submit
from scheduler_svc.sched.request import MigratedRequest
from scheduler_svc.telemetry.families import CumulativeSources

log = logging.getLogger(__name__)
front_warning = RateLimitedLog(log)
UNPACK_SLICE = 16_384  # prompt ids turned into ints per turn of the event loop (~0.2-0.6 ms)


@dataclass(slots=True, eq=False)
class RemoteFront:
    """A connected front: the UpdateSink of the requests it submitted."""

    link: FrontLink
    identity: bytes
    front_id: str
    incarnation: int = 0  # (FrontHello's: which process of that front id)
    last_seen: float = field(default_factory=time.monotonic)
    alive: bool = True

    @property
    def prefix(self) -> str:
        return self.front_id + ":"

    @property
    def metrics_key(self) -> tuple[str, int]:
        return self.front_id, self.incarnation  # (a process of that front id: its counters' own)

    def deliver(self, updates: list[RequestUpdate]) -> None:
        self.link.send(self, m.Updates(updates))


class FrontLink:
    def __init__(self, core: EngineCore, endpoint: str, keys: KeyPair | None = None,
                 exposition: Callable[[], str] | None = None, trusted: Path | None = None,
                 own_families: Callable[[], list] | None = None, limits: RequestLimits | None = None) -> None:
        """``keys``: the scheduler's key pair (a CURVE link: fronts of their own); ``trusted``: the
        front keys it admits (``--trusted-front-keys``); ``limits``: what one request may ask for
        (the core's own --max-n and the rest; by default, their defaults)."""
        self.core, self.endpoint, self.keys = core, endpoint, keys
        self.limits = limits if limits is not None else RequestLimits()
        self.exposition = exposition or (lambda: "")  # the deployment's metrics, for a Query
        self.own_families = own_families or list  # this core's own metrics (the first core sums the others')
        self.fronts: dict[bytes, RemoteFront] = {}
        self._lora_tasks: set[asyncio.Task] = set()
        self.front_metrics = CumulativeSources()  # by front process (the counters of fronts gone kept)
        self._ctx = zmq.Context.instance()
        if keys is not None:
            if trusted is None:
                raise ValueError(f"{FLAG}: a front link with keys needs the front keys it admits")
            self._ctx = core.hub.curve_domain(ZAP_DOMAIN, FrontKeys(trusted))
        self._sock: RouterSocket | None = None
        self._tasks: list[asyncio.Task] = []
        self.failure: str | None = None  # why a task of the link ended unasked (liveness reports it)

    async def start(self) -> None:
        sock = zmq.Socket(self._ctx, zmq.ROUTER)  # a plain socket (the context may be an asyncio one)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.MAXMSGSIZE, m.MAX_FRAME_BYTES)
        if self.keys is not None:
            make_server(sock, self.keys, ZAP_DOMAIN.encode())
        sock.bind(self.endpoint)
        self.endpoint = sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._sock = RouterSocket(sock, asyncio.get_running_loop())
        self._tasks = [asyncio.create_task(self._recv_loop(), name="front-link-recv"),
                       asyncio.create_task(self._heartbeat_loop(), name="front-link-heartbeat")]
        for task in self._tasks:
            task.add_done_callback(self._task_ended)

    async def close(self) -> None:
        for t in self._tasks:
            t.remove_done_callback(self._task_ended)
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()

    def _task_ended(self, task: asyncio.Task) -> None:
        exc = None if task.cancelled() else task.exception()
        self.failure = f"{task.get_name()} ended: {exc!r}"
        log.critical("the front link failed: %s", self.failure, exc_info=exc)

    # ------------------------------------------------------------------ sending

    def send(self, front: RemoteFront, msg: m.Message) -> None:
        if not front.alive:
            return
        try:
            self._sock.send_multipart([front.identity, m.TIER.encode(msg)])
        except zmq.ZMQError as exc:  # gone, or not reading: it loses its requests, the core goes on
            self._drop(front, f"send failed: {exc}")

    def broadcast_status(self) -> None:
        status = self._status()
        for front in list(self.fronts.values()):
            self.send(front, status)

    async def _lora_update(self, front: RemoteFront, msg: m.LoraUpdate) -> None:
        """Load or unload an adapter (its files read off the loop); every front hears of the new list
        (a Status) before this one's answer, so the name is usable there when the call returns."""
        registry, answer = self.core.lora, m.Answer(msg.query_id)
        if not self.core.cfg.allow_runtime_lora_updating:
            answer.error = "loading LoRA adapters at run time is off (--allow-runtime-lora-updating)"
        elif msg.path is None:
            try:
                registry.unload(msg.name)
            except KeyError:
                answer.error, answer.not_found = f"the LoRA adapter {msg.name!r} is not loaded", True
        else:
            try:
                module = await asyncio.to_thread(inspect_adapter, msg.name, Path(msg.path), registry.max_rank)
                registry.add(module)
            except LoraConfigError as exc:
                answer.error = str(exc)
            except Exception as exc:  # noqa: BLE001  a bug here answers the caller instead of leaving it to time out
                log.exception("loading LoRA adapter %r failed unexpectedly", msg.name)
                answer.error = f"internal error while loading the adapter ({type(exc).__name__})"
        if answer.error is None:
            log.info("LoRA adapter %r %s", msg.name, "unloaded" if msg.path is None else f"loaded from {msg.path}")
            status = self._status()
            for f in list(self.fronts.values()):
                self.send(f, status)
        self.send(front, answer)

    def _status(self) -> m.Status:
        core = self.core
        return m.Status(core.is_ready(), core.model_info(), core.stats(), core.health_problem() or self.failure)

    # ------------------------------------------------------------------ receiving

    async def _recv_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                await self._receive(frames)
            except Exception as exc:  # noqa: BLE001  a bug here must not end the link
                front_warning("error while handling a front's frame: %s", "".join(traceback.format_exception(exc)))

    async def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            front_warning("dropping a message of %d frames from a front", len(frames))
            return
        identity, payload = frames
        front = self.fronts.get(identity)
        if front is None:
            try:
                hello = m.TIER.decode(payload, accept=(m.FrontHello,), max_bytes=MAX_HANDSHAKE_FRAME_BYTES)
            except WireError as exc:
                front_warning("dropping a frame from an unknown front %r: %s", identity[:64], exc)
                return
            self._hello(identity, hello)  # type: ignore[arg-type]
            return
        try:
            msg = m.TIER.decode(payload, accept=m.FROM_FRONT, max_bytes=m.MAX_FRAME_BYTES)
            front.last_seen = time.monotonic()
            if isinstance(msg, m.Submit):
                await self._submit(front, msg)
            else:
                self._dispatch(front, msg)
        except (WireError, _Foreign) as exc:
            self._drop(front, f"broke the front protocol: {exc}")

    def _hello(self, identity: bytes, hello: m.FrontHello) -> None:
        reason = None
        if hello.tier_version != m.TIER_VERSION:
            reason = f"tier version {hello.tier_version}, the core speaks {m.TIER_VERSION}"
        elif any(f.front_id == hello.front_id for f in self.fronts.values()):
            reason = f"front id {hello.front_id!r} is taken by a live front"
        reply = m.CoreHello(reason is None, reason or "", m.HEARTBEAT_INTERVAL_S, m.INCARNATION)
        try:
            self._sock.send_multipart([identity, m.TIER.encode(reply)])
        except zmq.ZMQError:
            return
        if reason is not None:
            front_warning("refused front %r: %s", hello.front_id, reason)
            return
        front = self.fronts[identity] = RemoteFront(self, identity, hello.front_id, hello.incarnation)
        log.info("front %s joined", hello.front_id)
        self.send(front, self._status())

    def _dispatch(self, front: RemoteFront, msg: m.Message) -> None:
        if isinstance(msg, m.Abort):
            self.core.abort(_owned(front, msg.request_id))
        elif isinstance(msg, m.FinishChoice):
            self.core.finish_choice(_owned(front, msg.request_id), msg.index)
        elif isinstance(msg, m.FrontMetrics):
            self.front_metrics.update(front.metrics_key, msg.families)
        elif isinstance(msg, m.Query):
            if msg.what == m.QUERY_STATS:
                self.send(front, m.Answer(msg.query_id, stats=self.core.stats()))
            elif msg.what == m.QUERY_FAMILIES:
                self.send(front, m.Answer(msg.query_id, families=self.own_families()))
            else:
                self.send(front, m.Answer(msg.query_id, text=self.exposition()))
        elif isinstance(msg, m.LoraUpdate):
            task = asyncio.create_task(self._lora_update(front, msg))
            self._lora_tasks.add(task)
            task.add_done_callback(self._lora_tasks.discard)
        elif isinstance(msg, m.FrontHello):
            raise _Foreign("a second FrontHello on a live connection")

    async def _submit(self, front: RemoteFront, msg: m.Submit) -> None:
        """Admit a front's request. One out of the core's bounds (submit_bounds.py; its prompt longer
        than the longest context too, before an int of it is built) fails alone, INVALID, naming
        the field and the limit: the front's other requests go on. (One past what the link carries
        did not decode: that front was dropped.)"""
        req = msg.request
        _owned(front, req.request_id)
        received = time.monotonic()
        n, info = m.num_packed(msg.prompt_ids), self.core.model_info()
        try:
            check_submit(msg, n, self.limits, info)
            req.prompt_token_ids = await _ints(m.unpacked(msg.prompt_ids), info.vocab_size if info else 1 << 32)
        except ValidationError as exc:  # (nothing of it reaches an executor)
            front.deliver([RequestUpdate(req.request_id, [], True, n, error=str(exc), error_kind=ErrorKind.INVALID)])
            return
        if not front.alive:  # it went away while its prompt was unpacked
            return
        resume = None
        if msg.resume_outputs is not None:  # it ran on an engine core that was lost
            resume = MigratedRequest(req, msg.resume_outputs, _finish_reasons(msg))
        req.arrival_time = received - msg.queued_s  # (the front's times are relative: clocks differ)
        req.deadline = None if msg.deadline_in_s is None else received + msg.deadline_in_s
        req.first_scheduled_at = None
        req.max_total_tokens = None  # fixed here, at its first placement
        req.lora_id = 0  # (which load of its adapter: the core's to say)
        try:
            self.core.submit(req, front, resume)
        except (EngineError, ValueError) as exc:
            kind = exc.kind if isinstance(exc, EngineError) else ErrorKind.FAILED
            front.deliver([RequestUpdate(req.request_id, [], True, len(req.prompt_token_ids), error=str(exc),
                                         error_kind=kind)])

    # ------------------------------------------------------------------ liveness

    async def _heartbeat_loop(self) -> None:
        limit = DEAD_AFTER_INTERVALS * m.HEARTBEAT_INTERVAL_S
        while True:
            await asyncio.sleep(m.HEARTBEAT_INTERVAL_S)
            now = time.monotonic()
            for front in list(self.fronts.values()):
                if now - front.last_seen > limit:
                    self._drop(front, f"silent for {now - front.last_seen:.1f}s")
            self.broadcast_status()

    def _drop(self, front: RemoteFront, why: str) -> None:
        """A front is gone (or broke the protocol): its requests are aborted, its counters kept."""
        if not front.alive:
            return
        front.alive = False
        if self.fronts.get(front.identity) is front:
            del self.fronts[front.identity]
        self.front_metrics.gone(front.metrics_key)
        n = self.core.abort_owned_by(front)
        log.warning("front %s dropped (%s); %d of its requests aborted", front.front_id, why, n)

    def drop_front(self, front_id: str, why: str) -> None:
        """The scheduler saw a local front exit: do not wait for its silence."""
        for front in list(self.fronts.values()):
            if front.front_id == front_id:
                self._drop(front, why)

    def front_families(self) -> list:
        """Every front's metrics summed, the counters of fronts gone included (for /metrics)."""
        return self.front_metrics.total()


class _Foreign(ValueError):
    """A front named a request it did not submit, or broke the protocol otherwise."""


def _finish_reasons(msg: m.Submit) -> list[FinishReason | None]:
    """How each choice of a resumed Submit ended (None: running), one per output (their values and
    count are bounded already: by the link, and by check_submit)."""
    outputs, finished = msg.resume_outputs or [], msg.resume_finished
    reasons = [None if r is None else FinishReason(r) for r in finished]
    return reasons + [None] * (len(outputs) - len(reasons))


async def _ints(ids: array, vocab_size: int) -> list[int]:
    """``ids`` as a list of ints, built ``UNPACK_SLICE`` at a time with the loop free between;
    ValidationError naming the first id outside the vocabulary (a front checks them, but the executor
    would refuse the whole plan carrying one, and every request in it would move; the check's cost
    as the core runs it: docs/PERF.md)."""
    out: list[int] = []
    for start in range(0, len(ids), UNPACK_SLICE):
        if start:
            await asyncio.sleep(0)
        part = ids[start:start + UNPACK_SLICE].tolist()
        check_token_ids("prompt_token_ids", part, vocab_size, start, unsigned=True)  # (uint32s: max alone)
        out += part
    return out


def _owned(front: RemoteFront, request_id: str) -> str:
    if not request_id.startswith(front.prefix):
        raise _Foreign(f"request id {request_id[:64]!r} is not one of front {front.front_id}'s")
    return request_id
