"""The executor's ZeroMQ side: dial in, handshake, heartbeats, plans in, results out.

Two threads. The main thread owns the DEALER socket: it handshakes, answers
and sends heartbeats, watches for a silent scheduler, forwards plans to the
compute thread and sends back what it returns. The compute thread owns the
runner and runs plans strictly in arrival order (in the executor process it has
also loaded the model and warmed it up: every torch call runs there, see
:class:`ComputeThread`); torch releases the GIL in its kernels, so heartbeats
keep flowing during a long step. Results come back over
an inproc PAIR socket (ZeroMQ sockets are never shared between threads).

Connection generations: every (re)connection gets a new number. Plans are
tagged with it; after a reconnect the compute thread skips stale plans and
resets the runner (the scheduler has declared us dead and re-sends whatever it
still wants us to run), and stale results are dropped.

Never exits on losing the scheduler: it reconnects and handshakes again. Exits
with 0 after a drain, 2 when the scheduler refuses the handshake, 3 when the
compute thread died (a bug; every plan's own failure is a result instead).
Nothing the scheduler sends ends the loop: a frame that does not decode is
dropped, and a ``Reset`` (after a refused plan) empties the runner's state
behind the plans already queued.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from executor_svc.pipeline import StepPipeline
from executor_svc.runner import ModelRunner
from executor_svc.unanswered import UnansweredDials
from pagedserve import wire
from pagedserve.ratelog import RateLimitedLog
from pagedserve.wire.enrollment import TokenFile
from pagedserve.wire.keys import ClientKeys, make_client

log = logging.getLogger(__name__)
peer_warning = RateLimitedLog(log)
_FROM_SCHEDULER = (wire.HandshakeReply, wire.Heartbeat, wire.BatchPlan, wire.Reset)

EXIT_OK, EXIT_REFUSED, EXIT_BROKEN = 0, 2, 3  # 3: the compute thread died (a bug): restart the process
_RESET = "reset"
_STOP = "stop"
_POLL_MS = 50
# Plain ints: pyzmq's constants are enum.Flag members, whose arithmetic costs more than the check.
_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)


@dataclasses.dataclass(slots=True)
class _Call:
    """Start-up work for the compute thread, and where its outcome goes."""
    fn: Callable[..., Any]
    args: tuple
    outcome: concurrent.futures.Future

    def run(self) -> None:
        try:
            self.outcome.set_result(self.fn(*self.args))
        except BaseException as exc:  # handed to the caller, which raises it on its own thread
            self.outcome.set_exception(exc)


@dataclasses.dataclass(slots=True)
class _Serve:
    """The end of start-up: the runner to serve plans with, and the pipe its results go back on."""
    runner: ModelRunner
    ctx: zmq.Context
    endpoint: str


class ComputeThread(threading.Thread):
    """The executor's one thread for torch: start-up work (:meth:`call`), then plans in order.

    One thread, because an OpenMP runtime keeps a pool of worker threads per thread that starts
    parallel work. Weights loaded on one thread and steps run on another leave two pools, and
    with as many compute threads as CPUs libgomp then counts more threads than CPUs and stops
    spinning at its barriers: every parallel region ends in a sleep and a wake-up. Measured
    (bf16 default tiny model, 2 threads on 2 vCPUs): a 128-token prefill 41-47 ms against 27-30
    when one thread did both, a batch-1 decode step 2.6 against 1.9-2.2 ms. Warm-up on this
    thread also warms the pool and the allocator arena the first request uses.
    """

    def __init__(self) -> None:
        super().__init__(name="executor-compute", daemon=True)
        self.runner: ModelRunner | None = None  # set when the worker hands it over (_Serve)
        self.inbox: queue.Queue[tuple[int, wire.BatchPlan | _Call | _Serve | str]] = queue.Queue()
        self.current_gen = 0  # written by the main thread only
        self._serving = False  # serve() was called: calls would wait behind plans that never answer them

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` run on this thread (loading, warm-up); its result, or its exception raised here."""
        if self._serving:
            raise RuntimeError("the compute thread serves plans now: start-up work comes before serve()")
        if self.ident is None:
            self.start()
        outcome: concurrent.futures.Future = concurrent.futures.Future()
        self.inbox.put((-1, _Call(fn, args, outcome)))
        return outcome.result()

    def serve(self, runner: ModelRunner, ctx: zmq.Context, endpoint: str) -> None:
        """Run plans with ``runner`` from now on, results to the PAIR socket bound at ``endpoint``."""
        self._serving = True
        self.inbox.put((-1, _Serve(runner, ctx, endpoint)))

    def run(self) -> None:
        sock = None
        try:
            while True:  # start-up: calls, until the worker hands over the runner
                _, item = self.inbox.get()
                if item == _STOP:
                    return
                if isinstance(item, _Call):
                    item.run()
                elif isinstance(item, _Serve):
                    self.runner, sock = item.runner, item.ctx.socket(zmq.PAIR)
                    sock.connect(item.endpoint)
                    break
            self._serve_plans(sock)
        except BaseException:  # a bug (every plan's own failure is a result): the main thread exits on it
            log.critical("the compute thread failed; the executor exits so that it is restarted", exc_info=True)
            raise
        finally:
            if sock is not None:
                sock.close(linger=0)

    def _serve_plans(self, sock: zmq.Socket) -> None:
        """Plans in arrival order through the one step driver (executor_svc/pipeline.py). With
        ``prepare_ahead`` each plan already queued is prepared while the device runs the step
        before it, and a step completes once no plan is waiting; without, each plan is run to its
        end when it comes (nothing is ever in flight between two plans)."""
        pipeline = StepPipeline(self.runner, ahead=getattr(self.runner, "prepare_ahead", False))
        in_flight_gen = 0

        def send(result: wire.StepResult, gen: int) -> None:
            sock.send_multipart([str(gen).encode(), wire.encode(result)])

        while True:
            if pipeline.in_flight is None:
                gen, item = self.inbox.get()
            else:
                try:
                    gen, item = self.inbox.get_nowait()
                except queue.Empty:
                    send(pipeline.finish(), in_flight_gen)
                    continue
            if item in (_STOP, _RESET) or gen != in_flight_gen:
                if pipeline.in_flight is not None:  # (a stale generation's result is dropped by the main thread)
                    send(pipeline.finish(), in_flight_gen)
            if item == _STOP:
                return
            if item == _RESET:
                self.runner.reset()
            elif gen == self.current_gen:
                for result in pipeline.push(item):
                    send(result, gen)
                in_flight_gen = gen


class ExecutorWorker:
    def __init__(self, scheduler: str, runner: ModelRunner, handshake: wire.Handshake, *,
                 drain_timeout: float = 30.0, health=None, ctx: zmq.Context | None = None,
                 keys: ClientKeys | None = None, enrollment_token_file: Path | None = None,
                 compute: ComputeThread | None = None) -> None:
        """``compute``: the thread that built ``runner`` (its start-up work done with
        :meth:`ComputeThread.call`), which then runs its plans; by default a new one."""
        self.scheduler, self.handshake, self.health = scheduler, handshake, health
        self.endpoint = scheduler  # dialled now: the scheduler, or the engine core it redirected us to
        self.keys = keys  # CURVE client keys (None: the link is unencrypted, loopback setups)
        # With a token, every handshake proves this executor may enroll its key (pagedserve/wire/enrollment.py).
        self.enrollment = TokenFile(enrollment_token_file) if enrollment_token_file is not None else None
        self.drain_timeout = drain_timeout
        self.ctx = ctx or zmq.Context()
        self._pair = self.ctx.socket(zmq.PAIR)
        endpoint = f"inproc://executor-results-{id(self)}"
        self._pair.bind(endpoint)
        self.compute = compute or ComputeThread()
        self.compute.serve(runner, self.ctx, endpoint)
        self.gen = 0
        self.sock: zmq.Socket | None = None
        self.accepted = False
        self.interval = wire.DEFAULT_HEARTBEAT_INTERVAL_S
        self.inflight = 0
        self.last_recv = self.last_hb = self.last_plan = 0.0
        self.unanswered = UnansweredDials(handshake.executor_id)  # "id in use?" (unanswered.py)
        self._signals = 0  # SIGTERMs received (set from the signal handler)
        self.draining = False
        self.drain_deadline = 0.0

    def request_drain(self) -> None:
        """Signal-handler safe: the loop notices on its next turn (within ~50 ms)."""
        self._signals += 1

    # ---------------------------------------------------------------- connection

    def _connect(self) -> None:
        if self.sock is not None:
            self.sock.close(linger=0)
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, self.handshake.executor_id.encode())
        sock.setsockopt(zmq.LINGER, 1000)  # let the last results/Drain go out on exit
        sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        if self.keys is not None:
            make_client(sock, self.keys)
        self.unanswered.watch(sock)
        sock.connect(self.endpoint)
        self.sock = sock
        self.accepted = False
        self.interval = wire.DEFAULT_HEARTBEAT_INTERVAL_S
        self.last_recv = time.monotonic()
        hs = self.handshake
        if self.enrollment is not None and self.keys is not None:
            hs = msgspec.structs.replace(hs, enrollment_proof=self.enrollment.proof(self.keys, hs.executor_id))
        self._send(hs)
        log.info("dialled %s as %s; handshake sent", self.endpoint, self.handshake.executor_id)

    def _reconnect(self, why: str) -> None:
        log.warning("lost the scheduler (%s); reconnecting and dropping all sequence state", why)
        self.endpoint = self.scheduler  # (back to the directory, if an engine core redirected us)
        self.gen += 1
        self.compute.current_gen = self.gen
        self.compute.inbox.put((self.gen, _RESET))
        self.inflight = 0
        if self.health is not None:
            self.health.set_ready(False)
        self._connect()

    def _send(self, msg: wire.Message) -> None:
        self._send_raw(wire.encode(msg), type(msg).__name__)

    def _send_raw(self, payload: bytes, what: str) -> None:
        try:
            self.sock.send(payload, zmq.NOBLOCK)
        except zmq.Again:  # never block the loop on a stuck peer; its silence triggers a reconnect
            log.warning("send queue full; dropped a %s", what)

    # ---------------------------------------------------------------- main loop

    def run(self) -> int:
        if self.compute.ident is None:
            self.compute.start()
        self._connect()
        try:
            return self._loop()
        finally:
            self.compute.inbox.put((-1, _STOP))
            self.compute.join(timeout=5.0)
            self.unanswered.close()
            self.sock.close()
            self._pair.close(linger=0)

    def _loop(self) -> int:
        # A turn per message at batch 1 (a plan in, a result out), on CPUs the compute threads
        # fill: the poller is kept while the socket is, and the compute thread is looked at only
        # on a quiet turn (a step's result shows it alive).
        poller, polled = zmq.Poller(), None
        poller.register(self._pair, zmq.POLLIN)
        while True:
            if self._signals >= 2:
                log.warning("second termination signal: exiting now")
                return EXIT_OK
            if self._signals and not self.draining and (code := self._start_drain()) is not None:
                return code
            now = time.monotonic()
            if self.draining and (now >= self.drain_deadline or (
                    self.inflight == 0 and now - self.last_plan >= max(2 * self.interval, 0.5))):
                log.info("drained; exiting")
                return EXIT_OK
            if polled is not self.sock:  # (a new connection: the old socket is closed by now)
                if polled is not None:
                    poller.unregister(polled)
                poller.register(self.sock, zmq.POLLIN)
                polled = self.sock
            events = dict(poller.poll(_POLL_MS))
            if not events and not self.compute.is_alive():
                log.critical("the compute thread is gone; exiting")
                return EXIT_BROKEN
            if self._pair in events:
                self._forward_results()
            if self.sock in events and (code := self._receive()) is not None:
                return code
            if (code := self._timers()) is not None:
                return code

    def _start_drain(self) -> int | None:
        if not self.accepted:
            log.info("termination requested while not registered: exiting")
            return EXIT_OK
        log.info("termination requested: draining for up to %.1fs", self.drain_timeout)
        self.draining = True
        self.drain_deadline = time.monotonic() + self.drain_timeout
        self.last_plan = time.monotonic()
        if self.health is not None:
            self.health.set_ready(False)
        self._send(wire.Drain(self.drain_timeout))
        return None

    def _forward_results(self) -> None:
        while self._pair.getsockopt(_EVENTS) & _POLLIN:  # (cheaper than a receive raising zmq.Again)
            gen, payload = self._pair.recv_multipart(_NOBLOCK)
            if int(gen) == self.gen:
                self.inflight -= 1
                self._send_raw(payload, "StepResult")

    def _receive(self) -> int | None:
        sock = self.sock  # (a redirect below replaces self.sock: its messages are for the old one)
        while not sock.closed and sock.getsockopt(_EVENTS) & _POLLIN:
            frames = sock.recv_multipart(_NOBLOCK)
            for frame in frames:
                if not frame:
                    continue  # tolerate an empty delimiter frame
                try:
                    msg = wire.decode(frame, accept=_FROM_SCHEDULER)
                except wire.WireError as exc:  # (whatever the frame held: decode raises nothing else)
                    peer_warning("dropping a malformed frame (%d bytes): %s", len(frame), exc)
                    continue
                if (code := self._dispatch(msg)) is not None:
                    return code

    def _dispatch(self, msg: wire.Message) -> int | None:
        self.last_recv = time.monotonic()
        if isinstance(msg, wire.HandshakeReply):
            if self.accepted:
                return None
            if not msg.accepted and msg.redirect_port:
                self.endpoint = _with_port(self.scheduler, msg.redirect_port)
                log.info("the scheduler has several engine cores: this executor is scheduled by %s", self.endpoint)
                self._connect()
                return None
            if not msg.accepted:
                log.error("scheduler refused this executor: %s", msg.reason)
                return EXIT_REFUSED
            self.accepted = True
            self.unanswered.answered()
            self.interval = msg.heartbeat_interval_s if msg.heartbeat_interval_s > 0 else wire.DEFAULT_HEARTBEAT_INTERVAL_S
            self.last_hb = 0.0
            if self.health is not None and not self.draining:
                self.health.set_ready(True)
            log.info("registered with the scheduler (heartbeat %.2fs)", self.interval)
        elif isinstance(msg, wire.BatchPlan):
            if not self.accepted:
                log.warning("dropping plan %d received before the handshake was accepted", msg.step_id)
                return None
            self.inflight += 1
            self.last_plan = self.last_recv
            self.compute.inbox.put((self.gen, msg))
        elif isinstance(msg, wire.Reset):
            # After the plans already queued (each is still answered, refused): forget every sequence.
            log.warning("the scheduler reset this executor: %s", msg.reason)
            self.compute.inbox.put((self.gen, _RESET))
        elif not isinstance(msg, wire.Heartbeat):
            log.warning("dropping unexpected %s from the scheduler", type(msg).__name__)
        return None

    def _timers(self) -> int | None:
        now = time.monotonic()
        if self.accepted and now - self.last_hb >= self.interval:
            self.last_hb = now
            self._send(wire.Heartbeat(time.time()))
        if now - self.last_recv > wire.DEAD_AFTER_INTERVALS * self.interval:
            if self.draining:
                log.info("scheduler gone while draining; exiting")
                return EXIT_OK
            if not self.accepted:
                self.unanswered.silent()
            self._reconnect(f"silent for {now - self.last_recv:.1f}s")
        return None


def _with_port(endpoint: str, port: int) -> str:
    """``tcp://host:5556`` with another port (the engine core a directory sent us to)."""
    head, _, _ = endpoint.rpartition(":")
    return f"{head}:{port}"
