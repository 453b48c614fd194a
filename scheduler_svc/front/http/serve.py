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
h11 does: a client cannot make the process buffer an endless header. Neither parser, nor
uvicorn, bounds the time a connection may hold the server without a request in progress, so
the protocol does that too, and the server bounds TLS handshakes.
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

import httptools
import uvicorn
from starlette.types import ASGIApp
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from pagedserve.fd_limits import open_files_limit
from scheduler_svc.front.http.auth import OPEN_PATHS
from scheduler_svc.front.http.limits import CONNECTION_RESERVE, HttpLimits, connection_cap

log = logging.getLogger(__name__)

MAX_REQUEST_HEAD_BYTES = 16 * 1024  # request line + headers: h11's bound (uvicorn's other parser)
DEFAULT_LIMITS = HttpLimits()


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with each request's head bounded in size, and a connection's
    time without a request in progress bounded whatever bytes trickle in.

    Size: counted after the parser has seen each chunk. A chunk that leaves the head incomplete
    was all head (what the parser is buffering); one that completes it is not counted, so a body
    is never mistaken for a head. What is buffered stays below the bound plus one read. Over it:
    400 and the connection closed, as uvicorn answers a head h11 finds too long.

    Time: uvicorn bounds neither a new connection's wait for its first request nor a head sent a
    byte at a time, and any byte at all cancels its keep-alive timer (a bare CRLF between requests,
    which llhttp skips, cancels it and starts nothing), so a client could hold a connection and
    its buffer for ever. Here a connection without a request in progress is always on one of two
    clocks, and no byte resets either:

    - waiting: closed, silently, ``keep_alive_timeout_s`` after its last response, unless the
      first byte of a request arrives before;
    - in a head: the head must be whole within ``head_timeout_s`` of its first byte (a new
      connection's first head: of connecting); after that, 408 and the connection closed, or
      just closed when nothing was sent.

    So such a connection is closed at most ``keep_alive_timeout_s + head_timeout_s`` after its last
    response (``head_timeout_s`` after connecting, and its TLS handshake, bounded by the server).
    A request in progress (its head complete, its response not) is on neither clock: its body
    has its own limit (``--http-body-timeout-s``, app.py), and a response streams for as long as
    it produces tokens.

    Connections: past ``max_connections`` (limits.connection_cap) a request gets 503 unless it is a
    health probe or a scrape (OPEN_PATHS), so a flood of held connections is answered, not left to
    a kernel reset. Past the cap plus half the descriptor reserve a new connection is answered 503
    at once and closed: the rest of the reserve stays for the probes and the process's own links.
    """

    def __init__(self, *args: Any, limits: HttpLimits = DEFAULT_LIMITS, max_connections: int = 1 << 16,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._max_connections = max_connections
        self._in_head = True  # between a request's first byte and its headers' end
        self._head_bytes = 0
        self._head_timeout_s, self._keep_alive_s = limits.head_timeout_s, limits.keep_alive_timeout_s
        self._head_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self._max_connections + CONNECTION_RESERVE // 2:
            transport.write(_OVER_CAP)
            transport.close()
            return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        self._disarm_idle_timer()
        super().connection_lost(exc)
        # The protocol and its request cycle refer to each other, so a closed connection waits for
        # the cyclic collector, and with it the body bytes its cycle buffered and nobody read (a
        # body refused with 413 arrives anyway): ten clients flooding 8 MB bodies grew a front by
        # about 110 MB a second until a collection. Drop them now.
        cycle = self.cycle
        if cycle is not None:
            cycle.body = b""
        self.cycle = None

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
        self._disarm_idle_timer()
        self._arm_head_timer()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm_head_timer()
        over = len(self.connections) > self._max_connections
        if over and httptools.parse_url(self.url).path.decode("ascii", "replace") not in OPEN_PATHS:
            self.limit_concurrency = 0  # uvicorn's own 503 for this request, the connection kept
            try:
                super().on_headers_complete()
            finally:
                self.limit_concurrency = self.config.limit_concurrency
            return
        super().on_headers_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Not when closing, when the next head is already arriving (on its own clock), or when
        # uvicorn has just started a pipelined request (self.cycle is then that one).
        if not self.transport.is_closing() and not self._in_head and self.cycle.response_complete:
            self._idle_timer = self.loop.call_later(self._keep_alive_s, self._idle_timed_out)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self._head_timeout_s, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _disarm_idle_timer(self) -> None:
        if self._idle_timer is not None:
            self._idle_timer.cancel()
            self._idle_timer = None

    def _idle_timed_out(self) -> None:
        self._idle_timer = None
        if not self.transport.is_closing():
            self.transport.close()

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


_OVER_CAP = (STATUS_LINE[503] + b"content-type: text/plain; charset=utf-8\r\ncontent-length: 33\r\n"
             b"retry-after: 1\r\nconnection: close\r\n\r\nToo many connections; retry later")


class _EmbeddedServer(uvicorn.Server):
    """uvicorn's Server without its signal handlers (they would replace the process's own), and
    with a bound on TLS handshakes."""

    def __init__(self, config: uvicorn.Config, tls_handshake_timeout_s: float) -> None:
        super().__init__(config)
        self.tls_handshake_timeout_s = tls_handshake_timeout_s

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's startup for the sockets given, passing ``ssl_handshake_timeout``, which uvicorn
        leaves at asyncio's 60 s: a client that connects and stalls its handshake (the protocol
        above only starts once the handshake is done) holds the connection that long."""
        if sockets is None:
            raise RuntimeError("_EmbeddedServer serves the sockets it is given")
        await self.lifespan.startup()
        config = self.config

        def create_protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(config=config, server_state=self.server_state,  # type: ignore[call-arg]
                                              app_state=self.lifespan.state, _loop=_loop)

        loop = asyncio.get_running_loop()
        tls = {"ssl_handshake_timeout": self.tls_handshake_timeout_s} if config.ssl else {}
        self.servers = [await loop.create_server(create_protocol, sock=sock, ssl=config.ssl, backlog=config.backlog,
                                                 **tls) for sock in sockets]
        self.started = True


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


def _listening_socket(host: str, port: int, reuse_port: bool = False) -> socket.socket:
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
        if reuse_port:  # several fronts share the port; the kernel spreads connections among them
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


async def start_http_server(app: ASGIApp, host: str, port: int, ssl: Mapping[str, Any] | None = None,
                            limits: HttpLimits = DEFAULT_LIMITS, reuse_port: bool = False) -> HttpServer:
    """Bind ``host:port`` (0: a free port, see ``.port``) and serve ``app``; must run in the engine's loop.
    ``limits``: the connection bounds (keep-alive, head and TLS handshake timeouts) of HttpLimits.
    ``reuse_port``: other processes of this host (the scheduler's fronts) serve the same port."""
    cap = connection_cap(limits, open_files_limit())
    protocol = functools.partial(BoundedHttpToolsProtocol, limits=limits, max_connections=cap)
    config = uvicorn.Config(app, host=host, port=port, lifespan="off", access_log=False, log_config=None,
                            server_header=False, http=protocol, timeout_keep_alive=limits.keep_alive_timeout_s,
                            **dict(ssl or {}))
    server = _EmbeddedServer(config, limits.tls_handshake_timeout_s)
    sock = _listening_socket(host, port, reuse_port)
    bound = sock.getsockname()[1]
    task = asyncio.get_running_loop().create_task(server.serve(sockets=[sock]), name="http-server")
    while not server.started:
        if task.done():  # startup failed (e.g. a bad certificate): raise its error
            sock.close()
            task.result()
            raise RuntimeError("the HTTP server stopped during startup")
        await asyncio.sleep(0.01)
    log.info("OpenAI-compatible HTTP API listening on %s:%d (requests on at most %d connections)", host, bound, cap)
    return HttpServer(server, task, bound)
