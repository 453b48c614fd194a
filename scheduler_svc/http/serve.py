"""uvicorn on the scheduler's own asyncio loop, next to grpc.aio: no thread, no second process.

:func:`start_http_server` binds the port first (so port 0 reports the port it got, and a
port in use fails at startup), then runs uvicorn's ``Server.serve()`` as a task. uvicorn's
own signal handling is off: the scheduler process owns SIGTERM/SIGINT and stops this
server as part of its shutdown (__main__). ``ssl`` takes uvicorn's keyword arguments
(``ssl_certfile``, ``ssl_keyfile``, ``ssl_ca_certs``, ``ssl_cert_reqs``) for TLS.
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

log = logging.getLogger(__name__)


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
                            server_header=False, **dict(ssl or {}))
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
