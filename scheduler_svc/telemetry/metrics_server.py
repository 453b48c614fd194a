"""``/metrics`` on ``--metrics-port``: the deployment's exposition, served from a thread of the
engine core 0 process, bounded so that no scraper (the port is open to the cluster, without a key)
can hold the core's loop or its memory.

- The text is rendered at most every ``ttl_s`` (:class:`CachedExposition`), on the core's loop
  (its collectors read what the loop owns), however many scrapes come: a render costs the loop
  about 2 ms. The fronts' ``/metrics`` on the HTTP port read the same cache through the front link.
- At most ``MAX_CONNECTIONS`` connections are served at once, each a thread; one more is closed
  unanswered (a scraper retries at its next interval). A connection must send its request within
  ``READ_TIMEOUT_S`` of each read, so a silent one frees its thread, and a whole scrape must be
  done within ``CONNECTION_DEADLINE_S``, so one trickling its request a byte at a time does too.
- ``HEAD`` gets a GET's headers and no body (prometheus_client answers 405 with a body, which HTTP
  clients that probe with HEAD, aiperf's among them, reject).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)
MAX_CONNECTIONS = 16  # Prometheus, the gateway's picker and a few people at once
READ_TIMEOUT_S = 5.0
# The deployment's /metrics text is this fresh at worst: within the gateway picker's staleness limit
# (200 ms). Core 0 renders it at most this often, and a front asks core 0 for it at most this often.
EXPOSITION_TTL_S = 0.1
CONNECTION_DEADLINE_S = 15.0  # a whole scrape: request in, exposition out


class CachedExposition:
    """A registry's text exposition, rendered again only once ``ttl_s`` has passed. Its collectors
    read state the event loop owns, so it renders on the loop (``loop``: a scrape thread's call
    waits for it there); a fresh text is read from any thread."""

    def __init__(self, registry: CollectorRegistry, ttl_s: float,
                 loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.registry, self.ttl_s, self.loop = registry, ttl_s, loop
        self._text, self._at = b"", -math.inf

    def __call__(self) -> bytes:
        text, at = self._text, self._at
        if time.monotonic() - at <= self.ttl_s:
            return text
        if self.loop is None or _on(self.loop):
            return self._render()
        return asyncio.run_coroutine_threadsafe(self._render_async(), self.loop).result(timeout=READ_TIMEOUT_S)

    def _render(self) -> bytes:
        now = time.monotonic()
        if now - self._at > self.ttl_s:  # (another caller may have just rendered it)
            self._text, self._at = generate_latest(self.registry), now
        return self._text

    async def _render_async(self) -> bytes:
        return self._render()


def _on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


class _Quiet(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S  # (StreamRequestHandler: the connection's socket timeout)
    deadline_s = CONNECTION_DEADLINE_S

    def setup(self) -> None:
        super().setup()
        # A byte every few seconds never trips the read timeout: the whole exchange has a deadline.
        self._deadline = threading.Timer(self.deadline_s, self._cut)
        self._deadline.daemon = True
        self._deadline.start()

    def _cut(self) -> None:
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002  (scrapes are not news)
        pass


class _BoundedServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True
    request_queue_size = 128  # (socketserver's 5 drops the SYNs of a burst: its clients wait a second to retry)

    def __init__(self, address: tuple, handler: type, family: int) -> None:
        self.address_family = family
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the cap: closed unanswered, no thread started
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request, client_address) -> None:
        # (socketserver prints a traceback: a silent or vanished scraper is not worth one)
        log.debug("metrics connection from %s ended in error", client_address, exc_info=True)


def _app(text: Callable[[], bytes]):
    def app(environ, start_response):
        method, path = environ.get("REQUEST_METHOD"), environ.get("PATH_INFO", "/")
        if path not in ("/", "/metrics"):
            start_response("404 Not Found", [("Content-Type", "text/plain"), ("Content-Length", "10")])
            return [b"not found\n"]
        if method not in ("GET", "HEAD"):
            start_response("405 Method Not Allowed", [("Allow", "GET, HEAD"), ("Content-Length", "0")])
            return [b""]
        body = text()
        start_response("200 OK", [("Content-Type", CONTENT_TYPE_LATEST), ("Content-Length", str(len(body)))])
        return [b"" if method == "HEAD" else body]

    return app


@dataclass(slots=True)
class MetricsServer:
    """The running /metrics HTTP server (a daemon thread accepting, a thread per connection)."""

    httpd: WSGIServer
    thread: threading.Thread

    @property
    def port(self) -> int:
        return self.httpd.server_address[1]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


def start_metrics_server(port: int, text: CachedExposition | CollectorRegistry, host: str = "0.0.0.0") -> MetricsServer:
    """Serve ``text`` (or a registry's exposition, cached for ``EXPOSITION_TTL_S``) at http://host:port/metrics
    (port 0: a free port, see ``.port``)."""
    if isinstance(text, CollectorRegistry):
        text = CachedExposition(text, EXPOSITION_TTL_S)
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    httpd = make_server(host, port, _app(text), server_class=lambda addr, handler: _BoundedServer(addr, handler, family),
                        handler_class=_Quiet)
    thread = threading.Thread(target=httpd.serve_forever, name="metrics-http", daemon=True)
    thread.start()
    return MetricsServer(httpd, thread)
