"""The gRPC front's gate: what every call passes before its method's own handler runs.

grpc.aio reads a unary call's whole request message before it calls the handler (or an
interceptor's replacement for it), and gives an interceptor neither the peer nor a bound on that
read. So :class:`CallGate` serves each unary-request method as a request-streaming one (the
same bytes on the wire; the client cannot tell): the handler below starts as soon as the call's
headers have arrived and, in order,

1. rejects a peer that has failed too many API-key attempts (RESOURCE_EXHAUSTED, its key not
   even checked) and a call without an accepted key (UNAUTHENTICATED, counted against its
   peer: auth_throttle.py);
2. takes a slot of the process's :class:`~scheduler_svc.front.guards.admission.CallBudget`
   (RESOURCE_EXHAUSTED when none is free);
3. reserves room in the budget for a message of the largest size (``max_message_bytes``;
   RESOURCE_EXHAUSTED when the bytes held leave none), reads the request message, which must
   arrive whole within ``message_timeout_s`` of the call's start (DEADLINE_EXCEEDED), and keeps
   only its size, before it is parsed; a message larger than the served model can need
   (``message_cap``, guards/request_size.py) is refused unparsed (RESOURCE_EXHAUSTED); one over
   ``LARGE_MESSAGE_BYTES`` of a method with a ``precheck`` is parsed and its counts checked in the
   parse worker first (input/parse_pool.py: INVALID_ARGUMENT over a cap of
   guards/request_caps.py, UNAVAILABLE when the worker is busy), so the event loop only ever
   parses a large message whose repeated fields are within the model's caps;
4. runs the method's handler, and gives slot and bytes back when the call ends, however it ends.

Health checks (security.OPEN_METHODS) skip 1 and 2: probes carry no key and must pass under
load. In their place a peer may have at most ``MAX_OPEN_READS_PER_PEER`` of them reading their
request message at once (RESOURCE_EXHAUSTED past it): a message held up before its last byte keeps
up to ``max_message_bytes`` in grpc core for ``message_timeout_s``, and a keyless peer must not
multiply that without end. A probe's message comes with its headers, so probes never meet the cap;
a ``Watch`` holds no slot once its message is read. Request-streaming methods (reflection) get 1, 2 and 4, and each of their messages must
arrive within ``message_timeout_s`` of the one before.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from scheduler_svc.front.guards.admission import MAX_IN_FLIGHT_BYTES, CallBudget, Shed, Ticket
from scheduler_svc.front.guards.auth_throttle import AuthThrottle, peer_of_grpc
from scheduler_svc.front.guards.security import OPEN_METHODS, ApiKeys
from scheduler_svc.front.input.offload import trim_soon
from scheduler_svc.front.input.parse_pool import ParserBusy
from scheduler_svc.telemetry.metrics import Metrics

RESOURCE_EXHAUSTED, UNAUTHENTICATED = grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAUTHENTICATED
AUTH_THROTTLED = "auth_throttled"  # the shed reason counted in metrics
LARGE_MESSAGE_BYTES = 256 << 10  # parsed on the loop up to this: a few milliseconds at most
MAX_OPEN_READS_PER_PEER = 8  # keyless calls (health checks) of one peer reading their message at once
OPEN_READS = "open_reads_per_peer"  # the shed reason counted in metrics
Precheck = Callable[[bytes], Awaitable[str | None]]  # a message's problem, or None; ParserBusy


class _MessageLate(Exception):
    """A request-streaming call's next message did not arrive in time."""


class CallGate(grpc.aio.ServerInterceptor):
    def __init__(self, message_timeout_s: float, max_message_bytes: int, budget: CallBudget | None = None,
                 keys: ApiKeys | None = None, throttle: AuthThrottle | None = None,
                 metrics: Metrics | None = None, message_cap: Callable[[], int] | None = None,
                 prechecks: dict[str, Precheck] | None = None) -> None:
        self.message_timeout_s, self.max_message_bytes = message_timeout_s, max_message_bytes
        self.prechecks = prechecks or {}  # by method: a large message's counts, checked off the loop
        self.message_cap = message_cap  # the largest request the model can need (None: max_message_bytes)
        self.budget, self.keys, self.throttle, self.metrics = budget, keys, throttle, metrics
        self._open_reads: dict[str, int] = {}  # by peer: keyless calls reading their request message

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None:
            return None
        guarded = not details.method.startswith(OPEN_METHODS)
        authorization = _authorization(details.invocation_metadata) if guarded and self.keys is not None else None
        if handler.request_streaming:
            return self._streaming(handler, guarded, authorization)
        return self._unary(handler, guarded, authorization, self.prechecks.get(details.method))

    # ------------------------------------------------------------------ handlers
    def _unary(self, handler: grpc.RpcMethodHandler, guarded: bool, authorization: str | None,
               precheck: Precheck | None):
        original = _async(handler.unary_stream or handler.unary_unary)
        deserialize = handler.request_deserializer

        async def gated(_requests: Any, context: grpc.aio.ServicerContext):
            ticket = await self._admit(context, guarded, authorization)
            try:
                # In a list the handler pops: no frame here keeps a prompt of megabytes alive (an
                # abort's traceback holds these frames in a cycle until a full collection).
                read = self._read_request if guarded else self._read_open_request
                return await _respond(original, [await read(context, ticket, deserialize, precheck)], context)
            finally:
                if ticket is not None:
                    ticket.release()

        kind = grpc.stream_stream_rpc_method_handler if handler.response_streaming \
            else grpc.stream_unary_rpc_method_handler
        return kind(gated, request_deserializer=None, response_serializer=handler.response_serializer)

    def _streaming(self, handler: grpc.RpcMethodHandler, guarded: bool, authorization: str | None):
        original = _async(handler.stream_stream or handler.stream_unary)

        async def gated(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext):
            ticket = await self._admit(context, guarded, authorization)
            late = False
            try:
                return await _respond(original, [_each_within(requests, self.message_timeout_s)], context)
            except _MessageLate:
                late = True
            finally:
                if ticket is not None:
                    ticket.release()
            if late:
                await self._end_call(context, grpc.StatusCode.DEADLINE_EXCEEDED, self._late_message("the next message"))

        kind = grpc.stream_stream_rpc_method_handler if handler.response_streaming \
            else grpc.stream_unary_rpc_method_handler
        return kind(gated, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)

    # ------------------------------------------------------------------ the steps
    async def _admit(self, context: grpc.aio.ServicerContext, guarded: bool,
                     authorization: str | None) -> Ticket | None:
        """Steps 1 and 2: the caller's key (and its peer's failures), then a slot."""
        if not guarded:
            return None
        if self.keys is not None:
            await self._check_key(context, authorization)
        if self.budget is None:
            return None
        shed = None
        try:
            return self.budget.enter()
        except Shed as e:
            shed = e
        await self._shed(context, shed.reason, str(shed))  # (outside the except: no chained frames)

    async def _check_key(self, context: grpc.aio.ServicerContext, authorization: str | None) -> None:
        peer = peer_of_grpc(context.peer())
        wait = self.throttle.wait_s(peer) if self.throttle is not None else 0.0
        if wait:
            await self._shed(context, AUTH_THROTTLED, f"too many failed API-key attempts from {peer}; "
                                                      f"retry in {wait:.0f}s")
        if self.keys.authorizes(authorization):
            return
        if self.throttle is not None:
            self.throttle.failed(peer)
        await self._end_call(context, UNAUTHENTICATED, "missing or unknown API key: send 'authorization: Bearer <key>'")

    async def _read_open_request(self, context: grpc.aio.ServicerContext, ticket: None,
                                 deserialize: Callable[[bytes], Any] | None, precheck: Precheck | None = None) -> Any:
        """Step 3 for a keyless call: a slot among its peer's reads, then the message as any other."""
        peer = peer_of_grpc(context.peer())
        reading = self._open_reads.get(peer, 0)
        if reading >= MAX_OPEN_READS_PER_PEER:
            await self._shed(context, OPEN_READS, f"{peer} has {reading} keyless calls (health checks) waiting for "
                                                  f"their request message, at most {MAX_OPEN_READS_PER_PEER} at once")
        self._open_reads[peer] = reading + 1
        try:
            return await self._read_request(context, ticket, deserialize, precheck)
        finally:
            if (left := self._open_reads[peer] - 1) > 0:
                self._open_reads[peer] = left
            else:
                del self._open_reads[peer]

    async def _read_request(self, context: grpc.aio.ServicerContext, ticket: Ticket | None,
                            deserialize: Callable[[bytes], Any] | None, precheck: Precheck | None = None) -> Any:
        """Step 3: room for the message, the message in time, paid for, then parsed (unless the
        handler parses its own raw bytes: ``deserialize`` None)."""
        raw, shed, waiting = None, None, ticket is not None
        try:
            async with asyncio.timeout(self.message_timeout_s):
                if ticket is not None:
                    await ticket.reserve(min(self.max_message_bytes, ticket.budget.max_bytes))
                    waiting = False
                raw = await context.read()
                if ticket is not None and raw is not grpc.aio.EOF:
                    ticket.settle(len(raw))
        except TimeoutError:
            if waiting:
                shed = Shed(MAX_IN_FLIGHT_BYTES, "no room for the request message within --grpc-message-timeout-s "
                                                 f"({self.message_timeout_s:g}s): --max-in-flight-bytes "
                                                 f"({ticket.budget.max_bytes}) is taken; retry later")
        except Shed as e:
            shed = e
        if shed is not None:
            raw = None
            await self._shed(context, shed.reason, str(shed))
        if raw is None:
            await self._end_call(context, grpc.StatusCode.DEADLINE_EXCEEDED, self._late_message("the request message"))
        if raw is grpc.aio.EOF:
            await self._end_call(context, grpc.StatusCode.INVALID_ARGUMENT, "the call ended without a request message")
        cap = self.message_cap() if self.message_cap is not None else None
        if cap is not None and len(raw) > cap:
            size, raw = len(raw), None
            trim_soon()
            await self._end_call(context, RESOURCE_EXHAUSTED,
                                 f"request message: {size} bytes, at most {cap} for this model (room for a "
                                 "prompt of max_model_len tokens); refused before it was parsed")
        if precheck is not None and len(raw) > LARGE_MESSAGE_BYTES:
            refusal = await _precheck(precheck, raw)
            if refusal is not None:
                raw = None  # (the abort's traceback must not keep it)
                await self._end_call(context, *refusal)
        if deserialize is None:
            return raw
        try:
            return deserialize(raw)
        except Exception:
            problem = "the request is not a valid message"
        await self._end_call(context, grpc.StatusCode.INVALID_ARGUMENT, problem)

    async def _shed(self, context: grpc.aio.ServicerContext, reason: str, message: str) -> None:
        if self.metrics is not None:
            self.metrics.on_shed(reason)
        await self._end_call(context, RESOURCE_EXHAUSTED, message)

    async def _end_call(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        """End the call with ``code``, counted under its name as the servicer's error statuses are."""
        if self.metrics is not None:
            self.metrics.on_rejected(code.name)
        await context.abort(code, message)

    def _late_message(self, what: str) -> str:
        return f"{what} did not arrive within --grpc-message-timeout-s ({self.message_timeout_s:g}s)"


async def _precheck(precheck: Precheck, raw: bytes) -> tuple[grpc.StatusCode, str] | None:
    """The status refusing a large message after the parse worker read it, or None."""
    try:
        problem = await precheck(raw)
    except ParserBusy as e:
        return grpc.StatusCode.UNAVAILABLE, f"the server is parsing other large requests ({e}); retry shortly"
    finally:
        trim_soon()
    return None if problem is None else (grpc.StatusCode.INVALID_ARGUMENT, problem)


def _async(behavior: Callable) -> Callable:
    """The handler's behaviour, which must be asyncio's (a coroutine or async generator function)."""
    if not (inspect.iscoroutinefunction(behavior) or inspect.isasyncgenfunction(behavior)):
        raise RuntimeError(f"CallGate: {behavior!r} is not an async handler (the server is grpc.aio)")
    return behavior


async def _respond(behavior: Callable, request: list[Any], context: grpc.aio.ServicerContext) -> Any:
    """Run ``behavior`` on ``request``'s one item (popped): an async generator's responses are
    written here, a coroutine's returned."""
    if inspect.isasyncgenfunction(behavior):
        async for response in behavior(request.pop(), context):
            await context.write(response)
        return None
    return await behavior(request.pop(), context)


async def _each_within(requests: AsyncIterator[Any], timeout_s: float) -> AsyncIterator[Any]:
    iterator = aiter(requests)
    while True:
        try:
            async with asyncio.timeout(timeout_s):
                message = await anext(iterator)
        except StopAsyncIteration:
            return
        except TimeoutError:
            raise _MessageLate from None
        yield message


def _authorization(metadata) -> str | None:
    for key, value in metadata or ():
        if key == "authorization":
            return value
    return None
