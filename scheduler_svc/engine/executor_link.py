"""ZeroMQ transport to the executors: registry, handshakes, heartbeats, steps.

Executors dial in to one ROUTER socket (their routing id is their executor
id). The hub answers each handshake (executor_admission.py decides whether it
is admitted), keeps a heartbeat both ways, declares an executor dead after
``wire.DEAD_AFTER_INTERVALS`` silent intervals or a failed send, sends plans
and hands their results back in order: with asynchronous scheduling an
executor has up to two plans outstanding (one running, the next queued behind
it). It owns no scheduling state: it reports joins, drains and deaths through
callbacks and lets the engine decide.

Trust (docs/ARCHITECTURE.md, "Security model"): with keys the socket is a
CURVE server and its ZAP handler admits only the executor keys the trust store
admits (scheduler_svc/engine/executor_auth.py: trusted, or enrolling with a token; never
revoked), so without enrollment nothing from a peer without a trusted key reaches
this code. An executor id is bound to the connection (and key) that registered
it: a second connection claiming a live id is rejected, and a connected routing
id cannot be taken over (no ROUTER_HANDOVER). A live executor whose key is
revoked is dropped. Before its handshake is accepted a peer may send one small
handshake frame, which is all that is decoded; every frame is size-bounded by
libzmq first and decoded with typed, bounded readers. A result frame is checked
against the plan it answers (its step id, and a size no larger than that plan's
answer can be) before its body is parsed; a registered executor whose frame
breaks the contract is dropped at once. A step that does not come back within
the step timeout counts as the executor failing. Nothing a peer sends ends the
receive loop; if a transport task ends anyway, :attr:`ExecutorHub.failure` says
why and liveness reports it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio

from pagedserve import wire
from pagedserve.ratelog import RateLimitedLog
from pagedserve.wire.keys import ZAP_DOMAIN, make_server
from pagedserve.wire.router_socket import RouterSocket
from scheduler_svc.engine.executor_admission import ExecutorAdmission, identity_rejection
from scheduler_svc.engine.executor_auth import ExecutorAuth, LinkSecurity
from scheduler_svc.engine.executor_conn import ExecutorConn, SentPlan

log = logging.getLogger(__name__)
# What peers send wrong, at most one line per 10 s each: a flood of junk from unregistered peers
# must not hide a registered executor's protocol errors behind the same limit.
peer_warning = RateLimitedLog(log)
executor_warning = RateLimitedLog(log)
STEP_TIMEOUT_PER_STEP = 20  # a step may take this many times the executor's recent average...
_REGISTERED_KINDS = (wire.Heartbeat, wire.StepResult, wire.Drain, wire.Handshake)


class ExecutorLost(Exception):
    """The executor died (or was replaced) while a step was in flight."""


class ExecutorHub:
    """Accepts executors and runs steps on them. One per scheduler process."""

    def __init__(self, endpoint: str, *, block_size: int, heartbeat_interval_s: float,
                 on_join: Callable[[ExecutorConn], None],
                 on_drain: Callable[[ExecutorConn], None],
                 on_dead: Callable[[ExecutorConn, str], None],
                 keys: LinkSecurity | None = None, step_timeout_s: float = 30.0,
                 model_fingerprint: str | None = None, batch_invariant: bool = False) -> None:
        self.endpoint = endpoint
        self.heartbeat_interval_s = heartbeat_interval_s
        self.keys = keys  # None: no CURVE (the engine allows that on loopback only)
        self.step_timeout_s = step_timeout_s  # ...but never less than this
        self._auth = None
        self.trust: ExecutorAuth | None = None  # the keys admitted (with keys, from start())
        self._on_join, self._on_drain, self._on_dead = on_join, on_drain, on_dead
        # Several engine cores: the port of the core an executor should dial instead (None: this one).
        self.director: Callable[[wire.Handshake], int | None] = lambda hs: None
        self._ctx = zmq.asyncio.Context()  # (the ZAP authenticator runs on it, asynchronously)
        self._sock: RouterSocket | None = None
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self.failure: str | None = None  # why a transport task ended unasked (liveness reports it)
        self.conns: dict[bytes, ExecutorConn] = {}
        self.bound_port: int | None = None
        # What a handshake must agree with (the engine sets its draft_model after construction).
        self.admission = ExecutorAdmission(block_size, model_fingerprint=model_fingerprint,
                                           batch_invariant=batch_invariant)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self.keys is not None:
            from zmq.auth.asyncio import AsyncioAuthenticator

            self.trust = ExecutorAuth(self.keys)  # (the key files as they are now: they may change later)
            log.info("executor link: CurveZMQ, %s", self.trust.describe())
            self._auth = AsyncioAuthenticator(self._ctx)
            self._auth.start()
            self._auth.configure_curve_callback(ZAP_DOMAIN.decode(), self.trust)
        sock = zmq.Socket(self._ctx, zmq.ROUTER)  # a plain socket, driven by RouterSocket
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises
        # No ROUTER_HANDOVER: a connected routing id cannot be taken over by another connection.
        # A restarted executor gets its id back once the dead one's connection is closed: by the
        # kernel when the process died, else (a crashed or cut-off node sends no FIN) by libzmq's
        # own heartbeat after the same silence that declares an executor dead.
        dead_after_ms = int(wire.DEAD_AFTER_INTERVALS * self.heartbeat_interval_s * 1000)
        sock.setsockopt(zmq.HEARTBEAT_IVL, max(1, int(self.heartbeat_interval_s * 1000)))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, dead_after_ms)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_RESULT_FRAME_BYTES)  # libzmq drops peers sending more
        if self.keys is not None:
            make_server(sock, self.keys.server)
        sock.bind(self.endpoint)
        self.bound_port = int(sock.getsockopt(zmq.LAST_ENDPOINT).decode().rsplit(":", 1)[1])
        self._loop = asyncio.get_running_loop()  # (looked up once: a getpid() per call on 3.11)
        self._sock = RouterSocket(sock, self._loop, peer_keys=self.keys is not None)
        self._tasks = [asyncio.create_task(self._recv_loop(), name="executor-recv"),
                       asyncio.create_task(self._heartbeat_loop(), name="executor-heartbeat")]
        if self.trust is not None and self.keys.reloadable:
            self._tasks.append(asyncio.create_task(self.trust.watch(self._drop_untrusted), name="executor-keys"))
        for task in self._tasks:
            task.add_done_callback(self._task_ended)

    def _task_ended(self, task: asyncio.Task) -> None:
        """A transport task ended: only ``close()`` may end one. Anything else is recorded in
        :attr:`failure`, which liveness reports, so that the process is restarted."""
        if self._closing:
            return
        exc = None if task.cancelled() else task.exception()
        self.failure = f"{task.get_name()} ended: {exc!r}" if exc is not None else f"{task.get_name()} ended"
        log.critical("executor transport failed: %s", self.failure, exc_info=exc)

    def _reply(self, identity: bytes, reply: wire.HandshakeReply) -> None:
        try:
            self._sock.send_multipart([identity, wire.encode(reply)])
        except zmq.ZMQError as exc:
            log.warning("could not answer handshake of %r: %s", identity, exc)

    def curve_domain(self, domain: str, provider) -> zmq.Context:
        """Admit another CURVE server socket's clients (the front link's) through this process's ZAP
        handler, under ``domain``, by ``provider.callback(domain, key)``; the context that socket
        must be made on. RuntimeError when this link has no keys (nor a ZAP handler)."""
        if self._auth is None:
            raise RuntimeError("no ZAP handler: the executor link has no keys")
        self._auth.configure_curve_callback(domain, provider)
        return self._ctx

    async def close(self) -> None:
        self._closing = True
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sock is not None:
            self._sock.close()
        if self._auth is not None:
            self._auth.stop()
        self._ctx.term()

    # ------------------------------------------------------------------ steps

    async def send_plan(self, conn: ExecutorConn, plan: wire.BatchPlan, max_result_bytes: int) -> None:
        """Send a plan without waiting for its result; ExecutorLost if the executor is gone.
        ``max_result_bytes``: the largest answer it can have; a larger one breaks the contract."""
        if conn.state == "dead":
            raise ExecutorLost(conn.id)
        if not conn.in_flight:
            conn.oldest_since = time.monotonic()
        conn.in_flight.append(SentPlan(plan.step_id, max_result_bytes, self._loop.create_future()))
        if not await self._send(conn, plan):
            raise ExecutorLost(conn.id)

    async def next_result(self, conn: ExecutorConn) -> wire.StepResult:
        """The result of the oldest plan sent; ExecutorLost if the executor dies first."""
        if not conn.in_flight:
            raise RuntimeError(f"executor {conn.id}: no plan in flight to wait for")
        fut = conn.in_flight[0].result
        try:
            return await fut
        finally:
            if conn.in_flight and conn.in_flight[0].result is fut:
                conn.in_flight.popleft()

    @staticmethod
    def result_ready(conn: ExecutorConn) -> bool:
        """Whether the oldest plan's result (or the executor's death) has arrived."""
        return bool(conn.in_flight) and conn.in_flight[0].result.done()

    def reset(self, conn: ExecutorConn, why: str) -> None:
        """Tell the executor to forget every sequence (it refused a plan: the two views parted). The
        plans still in flight are discarded: their answers are dropped unread, and nobody waits for
        them. The engine has taken the executor's requests back; the plans it sends next start afresh."""
        for sent in conn.in_flight:
            conn.discarded.add(sent.step_id)
            sent.result.cancel()
        conn.in_flight.clear()
        self._send_now(conn, wire.Reset(why[:wire.MAX_TEXT_CHARS]))

    def _send_now(self, conn: ExecutorConn, msg: wire.Message) -> bool:
        try:
            self._sock.send_multipart([conn.identity, wire.encode(msg)])
            return True
        except zmq.ZMQError as exc:
            self._declare_dead(conn, f"send failed: {exc}")
            return False

    # ------------------------------------------------------------------ internals

    async def _send(self, conn: ExecutorConn, msg: wire.Message) -> bool:
        return self._send_now(conn, msg)

    async def _recv_loop(self) -> None:
        """Every frame, whatever it holds, ends here as a message handled, a frame dropped or a peer
        dropped: nothing a peer sends stops this loop (an unexpected error is logged, rate-limited,
        and the loop goes on). If it ends anyway, :attr:`failure` says so and liveness reports it."""
        while True:
            try:
                frames = await self._sock.recv_multipart()
            except zmq.ZMQError as exc:
                log.warning("executor socket receive failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            try:
                await self._receive(frames)
            except Exception:  # noqa: BLE001  a bug here must not end the transport
                executor_warning("error while handling a frame from %r", frames[0][:64] if frames else b"",
                                 exc_info=True)

    async def _receive(self, frames: list[bytes]) -> None:
        if len(frames) != 2:
            peer_warning("dropping a message of %d frames (expected identity + payload)", len(frames))
            return
        identity, payload = frames
        conn = self.conns.get(identity)
        if conn is None or conn.state == "dead":  # not registered: a small handshake is all we read from it
            try:
                msg = wire.decode(payload, accept=(wire.Handshake,), max_bytes=wire.MAX_HANDSHAKE_FRAME_BYTES)
            except wire.WireError as exc:
                peer_warning("dropping a malformed frame from %r: %s", identity[:64], exc)
                return
            await self._handshake(identity, msg)  # type: ignore[arg-type]
            return
        try:
            env = wire.read_envelope(payload, accept=_REGISTERED_KINDS, max_bytes=wire.MAX_RESULT_FRAME_BYTES)
            waiting = self._expected(conn, env) if env.kind is wire.StepResult else None
            if env.kind is wire.StepResult and waiting is None:
                return  # the answer to a plan discarded by a reset: dropped unread
            msg = wire.decode_body(env)
        except wire.WireError as exc:
            # An authenticated executor sent what the contract forbids: a bug or an attack, either way
            # nothing more of it is trusted. Its requests move to other executors.
            self._declare_dead(conn, f"protocol error: {exc}")
            return
        conn.last_seen = time.monotonic()
        if waiting is not None:
            self._resolve(conn, waiting, msg)  # type: ignore[arg-type]
        elif isinstance(msg, wire.Drain):
            self._drain(conn, msg)
        elif isinstance(msg, wire.Handshake):  # the same id dialled in again: that process lost its state
            await self._handshake(identity, msg)

    def _expected(self, conn: ExecutorConn, env: wire.Envelope) -> SentPlan | None:
        """The plan a result frame answers, checked before its body is parsed: the oldest plan not yet
        answered, and a frame no larger than that plan's answer can be. None: a discarded plan's.
        WireError for anything else (a step never sent, out of order, or too large)."""
        if env.tag in conn.discarded:
            conn.discarded.discard(env.tag)
            return None
        waiting = next((sent for sent in conn.in_flight if not sent.result.done()), None)
        if waiting is None or env.tag != waiting.step_id:
            raise wire.WireError(f"a result for step {env.tag}, expected "
                                 f"{waiting.step_id if waiting else 'none (no plan in flight)'}")
        if env.size > waiting.max_result_bytes:
            raise wire.WireError(f"the result of step {env.tag} has {env.size} bytes; its plan allows at most "
                                 f"{waiting.max_result_bytes}")
        return waiting

    def _resolve(self, conn: ExecutorConn, waiting: SentPlan, result: wire.StepResult) -> None:
        waiting.result.set_result(result)
        now = conn.last_seen
        took = now - conn.oldest_since
        conn.step_seconds = took if not conn.step_seconds else 0.9 * conn.step_seconds + 0.1 * took
        conn.oldest_since = now  # the next plan (if queued) started when this one ended

    def _drain(self, conn: ExecutorConn, msg: wire.Drain) -> None:
        if conn.state == "ready":
            conn.state = "draining"
            # Migrate what is left a little before the executor's own deadline, so
            # the last steps' tokens are not lost in flight when it exits.
            margin = 2 * self.heartbeat_interval_s
            conn.drain_deadline = time.monotonic() + max(0.0, msg.grace_seconds - margin)
            log.info("executor %s is draining (grace %.1fs)", conn.id, msg.grace_seconds)
            self._notify(self._on_drain, conn)

    def _notify(self, callback: Callable, *args) -> None:
        """Run an engine callback; its bug is logged, never raised into the transport's loops."""
        try:
            callback(*args)
        except Exception:  # noqa: BLE001
            log.exception("error in the engine's %s callback", getattr(callback, "__name__", "executor"))

    async def _handshake(self, identity: bytes, hs: wire.Handshake) -> None:
        key = self._sock.peer_key(identity)  # the CURVE key this very connection authenticated with
        old = self.conns.get(identity)
        if old is not None and old.state != "dead":
            # The same connection handshakes again: that process restarted and lost its KV cache.
            self._declare_dead(old, "executor reconnected (its state is gone)")
        reason, enrolled = identity_rejection(self.conns.values(), self.trust, identity, key, hs)
        reason = reason or self.admission.rejection(hs)
        if reason is None and (port := self.director(hs)) is not None:
            # Several engine cores: this port is their directory, and another core is to schedule it.
            self._reply(identity, wire.HandshakeReply(False, "", self.heartbeat_interval_s, redirect_port=port))
            log.info("executor %s sent to the engine core on port %d", hs.executor_id, port)
            return
        reply = wire.HandshakeReply(reason is None, reason or "", self.heartbeat_interval_s)
        try:
            self._sock.send_multipart([identity, wire.encode(reply)])
        except zmq.ZMQError as exc:
            log.warning("could not answer handshake of %r: %s", identity, exc)
            return
        if reason is not None:
            peer_warning("refused executor %r (connection %r%s): %s", hs.executor_id, identity[:64],
                         f", key {key.decode()}" if key else "", reason)
            return
        self.admission.accepted(hs)
        conn = ExecutorConn(identity, hs, peer_key=key, enrolled=enrolled)
        self.conns[identity] = conn
        log.info("executor %s joined: %d device blocks, %d cpu blocks, %s/%s%s",
                 hs.executor_id, hs.num_device_blocks, hs.num_cpu_blocks, hs.device, hs.dtype,
                 "" if key is None else f", key {key.decode()} ({'enrolled' if enrolled else 'trusted'})")
        self._on_join(conn)

    def _drop_untrusted(self) -> None:
        """After the trust store changed: drop each live executor whose key it no longer admits (its
        requests migrate, as after any executor's death)."""
        for conn in list(self.conns.values()):
            if conn.peer_key is not None and not self.trust.still_admitted(conn.peer_key, conn.enrolled):
                self._declare_dead(conn, f"its key {conn.peer_key.decode()} is revoked or no longer trusted")

    def drop(self, conn: ExecutorConn, why: str) -> None:
        """Forget an executor (the engine gave up on it); it must handshake again."""
        self._declare_dead(conn, why)

    def _declare_dead(self, conn: ExecutorConn, why: str) -> None:
        if conn.state == "dead":
            return
        conn.state = "dead"
        log.warning("executor %s declared dead: %s", conn.id, why)
        for sent in conn.in_flight:
            if not sent.result.done():
                sent.result.set_exception(ExecutorLost(f"{conn.id}: {why}"))
                sent.result.exception()  # retrieved: the engine awaits only the oldest; the rest die with it
        if self.conns.get(conn.identity) is conn:
            del self.conns[conn.identity]
        self._notify(self._on_dead, conn, why)

    def step_timeout(self, conn: ExecutorConn) -> float:
        """How long the oldest plan in flight may take: sized from the executor's recent steps,
        never less than the configured floor (a first step may compile kernels)."""
        return max(self.step_timeout_s, STEP_TIMEOUT_PER_STEP * conn.step_seconds)

    async def _heartbeat_loop(self) -> None:
        limit = wire.DEAD_AFTER_INTERVALS * self.heartbeat_interval_s
        while True:
            await asyncio.sleep(self.heartbeat_interval_s)
            now = time.monotonic()
            for conn in list(self.conns.values()):
                try:
                    await self._beat(conn, now, limit)
                except Exception:  # noqa: BLE001  a bug for one executor must not stop the others' heartbeats
                    executor_warning("heartbeat of executor %s failed", conn.id, exc_info=True)

    async def _beat(self, conn: ExecutorConn, now: float, limit: float) -> None:
        if now - conn.last_seen > limit:
            self._declare_dead(conn, f"silent for {now - conn.last_seen:.1f}s")
        elif conn.in_flight and now - conn.oldest_since > self.step_timeout(conn):
            # Heartbeating but not answering (a stuck device, or a peer swallowing plans).
            self._declare_dead(conn, f"step {conn.in_flight[0].step_id} did not come back within "
                                     f"{self.step_timeout(conn):.0f}s (--step-timeout)")
        else:
            await self._send(conn, wire.Heartbeat(time.time()))
