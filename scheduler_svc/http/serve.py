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
h11 does: a client cannot make the process buffer an endless header.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

MAX_REQUEST_HEAD_BYTES = 16 * 1024  # request line + headers: h11's bound (uvicorn's other parser)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with each request's head bounded by MAX_REQUEST_HEAD_BYTES.

    Counted after the parser has seen each chunk: a chunk that leaves the head incomplete was
    all head (what the parser is buffering), one that completes it is not counted, so a body is
    never mistaken for a head. What is buffered stays below the bound plus one read. Over it:
    400 and the connection closed, as uvicorn answers a head h11 finds too long.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = True  # between a request's first byte and its headers' end
        self._head_bytes = 0

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

    def on_headers_complete(self) -> None:
        self._in_head = False
        super().on_headers_complete()


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


async def start_http_server(app: ASGIApp, host: str, port: int, ssl: Mapping[str, Any] | None = None
                            ) -> HttpServer:
    """Bind ``host:port`` (0: a free port, see ``.port``) and serve ``app``; must run in the engine's loop."""
    config = uvicorn.Config(app, host=host, port=port, lifespan="off", access_log=False, log_config=None,
                            server_header=False, http=BoundedHttpToolsProtocol, **dict(ssl or {}))
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
