"""Engine streams for the HTTP front: merging a batch, client disconnects, server-sent events.

Whatever ends a response early (the client goes away, an error, the server stops) closes
every engine stream of the request at once, which is the engine's signal to abort it
and free its blocks, as for a cancelled gRPC call.

SSE format: one ``data: <json>\\n\\n`` event per chunk; the stream ends with
``data: [DONE]\\n\\n``. An error after the response has started (the status is already
200) is sent as ``data: {"error": {...}}`` before ``[DONE]``, as vLLM does; the openai
client raises it as an APIError.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagedserve.engine_api import RequestOutput

T = TypeVar("T")
Tagged = tuple[int, RequestOutput]  # (prompt index, output)

DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}  # no proxy buffering either
_encode = msgspec.json.Encoder().encode


def sse_event(body: Any) -> bytes:
    return b"data: " + _encode(body) + b"\n\n"


def json_bytes(body: Any) -> bytes:
    return _encode(body)


class ClientGone(Exception):
    """The client disconnected before the response was ready."""


async def until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client disconnects first (then raise ClientGone).

    Only valid once the request body has been read: after that, ``receive()`` yields
    nothing but the disconnect.
    """
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnect(request.receive))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not task.done():  # the client left, or we were cancelled: stop the work
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        watch.cancel()
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def single(stream: AsyncIterator[RequestOutput]) -> AsyncIterator[Tagged]:
    """One engine stream as (0, output) pairs; closing this closes the engine's stream."""
    async with contextlib.aclosing(stream):
        async for out in stream:
            yield 0, out


async def merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[Tagged]:
    """Several engine streams (a batch of prompts) interleaved as (prompt index, output).

    The first error of any stream ends the merge; closing it closes every stream.
    """
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async with contextlib.aclosing(stream):
                async for out in stream:
                    queue.put_nowait((i, out, None))
        except Exception as e:
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, out, err = await queue.get()
            if err is not None:
                raise err
            if out is None:
                left -= 1
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()  # a pump cancelled while it waits closes the engine's stream (abort + free)
        await asyncio.gather(*tasks, return_exceptions=True)


SERVER_SEND = "pagedserve.server_send"  # scope key: the server's own ``send`` (set by the app: asgi_app.build_app)


class EventStreamResponse(StreamingResponse):
    """SSE whose event source is closed as soon as the response ends, however it ends.

    The response start goes through Starlette's middleware, which so learns that the response has
    begun (an error after it can no longer become a 500); the events go straight to the server's
    ``send`` (``scope[SERVER_SEND]``), as nothing between them and the server changes a body: two
    middleware hops and Starlette's streaming loop were ~9% of the HTTP front's CPU per token.
    The client's disconnect (read from ``receive``, ASGI 2.3) stops the stream; closing the source
    then (not whenever the garbage collector gets to it) aborts the engine requests at once.
    """

    def __init__(self, events: AsyncIterator[bytes]) -> None:
        super().__init__(events, media_type="text/event-stream", headers=SSE_HEADERS)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            body = asyncio.ensure_future(self._body(scope.get(SERVER_SEND, send)))
            watch = asyncio.ensure_future(_disconnect(receive))
            try:
                await asyncio.wait((body, watch), return_when=asyncio.FIRST_COMPLETED)
            finally:
                watch.cancel()
                if not body.done():  # the client left, or the server is stopping: end the stream
                    body.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await body
            if not body.cancelled():
                with contextlib.suppress(OSError):  # (a server of ASGI 2.4 fails a send to a client gone)
                    body.result()  # any other error while sending is the response's
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]

    async def _body(self, send: Send) -> None:
        async for event in self.body_iterator:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def sse_events(first: Tagged, rest: AsyncIterator[Tagged], chunk: Callable[[int, RequestOutput], list[Any]],
                     tail: Callable[[], Any | None], on_error: Callable[[BaseException], Any]
                     ) -> AsyncIterator[bytes]:
    """The SSE bytes of a response: ``chunk(prompt, out)``'s events per output (one per choice
    that moved; none when everything is held back), ``tail()`` once at the end (e.g. the usage
    chunk), ``on_error(exc)`` as an error event."""
    async with contextlib.aclosing(rest):
        try:
            for body in chunk(*first):
                yield sse_event(body)
            async for prompt, out in rest:
                for body in chunk(prompt, out):
                    yield sse_event(body)
            body = tail()
            if body is not None:
                yield sse_event(body)
        except Exception as e:
            yield sse_event(on_error(e))
        yield DONE
