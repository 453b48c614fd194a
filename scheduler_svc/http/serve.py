"""uvicorn on the scheduler's own asyncio loop, next to grpc.aio: no thread, no second process.

:func:`start_http_server` binds the port first (so port 0 reports the port it got, and a
port in use fails at startup), then runs uvicorn's ``Server.serve()`` as a task. uvicorn's
own signal handling is off: the scheduler process owns SIGTERM/SIGINT and stops this
server as part of its shutdown (__main__). ``ssl`` takes uvicorn's keyword arguments
(``ssl_certfile``, ``ssl_keyfile``, ``ssl_ca_certs``, ``ssl_cert_reqs``) for TLS.

HTTP/1.1 is parsed by httptools (llhttp, in C) rather than h11 (pure Python): each
streamed event costs the scheduler ~28% less CPU (docs/PERF.md, "Streaming cost of the
fronts"). llhttp does not bound a request's head, and httptools keeps a header value it
is still receiving whole, so :class:`BoundedHttpToolsProtocol` bounds the head itself, as
h11 does: a client cannot make the process buffer an endless header. Neither parser bounds
the time a head takes, so the protocol does that too.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from scheduler_svc.http.limits import HttpLimits

log = logging.getLogger(__name__)

MAX_REQUEST_HEAD_BYTES = 16 * 1024  # request line + headers: h11's bound (uvicorn's other parser)
DEFAULT_HEAD_TIMEOUT_S = HttpLimits().head_timeout_s


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with each request's head bounded in size and in time.

    Size: counted after the parser has seen each chunk. A chunk that leaves the head incomplete
    was all head (what the parser is buffering); one that completes it is not counted, so a body
    is never mistaken for a head. What is buffered stays below the bound plus one read. Over it:
    400 and the connection closed, as uvicorn answers a head h11 finds too long.

    Time: uvicorn bounds neither a new connection's wait for its first request nor a head sent a
    byte at a time (any byte resets its keep-alive timer), so a client could hold a connection
    and its buffer for ever. A head must be whole within ``head_timeout_s`` of its first byte
    (a new connection's: of connecting); after that, 408 and the connection closed, or just
    closed when nothing was sent. The time between requests stays uvicorn's keep-alive timeout.
    """

    def __init__(self, *args: Any, head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # between a request's first byte and its headers' end
        self._head_bytes = 0
        self._head_timeout_s = head_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._in_head and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_REQUEST_HEAD_BYTES:
                log.warning("closing a connection whose request head passed %d bytes", MAX_REQUEST_HEAD_BYTES)
                self.send_400_response("Request head too large.")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._head_bytes = True, 0
        self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        super().on_headers_complete()

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self._head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self._in_head or self.transport.is_closing():
            return
        if not self._head_bytes:  # connected and sent nothing: nobody to answer
            self.transport.close()
            return
        log.warning("closing a connection whose request head took over %gs", self._head_timeout_s)
        msg = b"Request head not received in time."
        self.transport.write(b"".join([STATUS_LINE[408], b"content-type: text/plain; charset=utf-8\r\n",
                                       b"content-length: %d\r\nconnection: close\r\n\r\n" % len(msg), msg]))
        self.transport.close()


class _EmbeddedServer(uvicorn.Server):
    """uvicorn's Server without its signal handlers (they would replace the process's own)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@dataclass
class HttpServer:
    server: uvicorn.Server
    task: asyncio.Task
    port: int

    async def stop(self, grace: float) -> None:
        """Stop accepting, give open responses ``grace`` seconds, then cancel them (engine aborts)."""
        self.server.config.timeout_graceful_shutdown = max(grace, 0.1)
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), grace + 5.0)
        except asyncio.TimeoutError:
            log.warning("HTTP server did not stop within %.0fs; cancelling it", grace + 5.0)
            self.task.cancel()
            with contextlib.suppress(BaseException):
                await self.task


def _listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port``, created with proto=IPPROTO_TCP.

    asyncio sets TCP_NODELAY only on connections whose socket says IPPROTO_TCP, and
    accepted sockets inherit the listener's proto; uvicorn's own bind_socket() leaves it 0,
    and Nagle's algorithm then holds each small SSE write until the client's delayed ACK
    (~40 ms a chunk on Linux).
    """
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         proto=socket.IPPROTO_TCP, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


async def start_http_server(app: ASGIApp, host: str, port: int, ssl: Mapping[str, Any] | None = None,
                            head_timeout_s: float = DEFAULT_HEAD_TIMEOUT_S) -> HttpServer:
    """Bind ``host:port`` (0: a free port, see ``.port``) and serve ``app``; must run in the engine's loop."""
    protocol = functools.partial(BoundedHttpToolsProtocol, head_timeout_s=head_timeout_s)
    config = uvicorn.Config(app, host=host, port=port, lifespan="off", access_log=False, log_config=None,
                            server_header=False, http=protocol, **dict(ssl or {}))
    server = _EmbeddedServer(config)
    sock = _listening_socket(host, port)
    bound = sock.getsockname()[1]
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="http-server")
    while not server.started:
        if task.done():  # startup failed (e.g. a bad certificate): raise its error
            sock.close()
            task.result()
            raise RuntimeError("the HTTP server stopped during startup")
        await asyncio.sleep(0.01)
    log.info("OpenAI-compatible HTTP API listening on %s:%d", host, bound)
    return HttpServer(server, task, bound)
