"""/metrics on --metrics-port (telemetry/metrics_server.py): open to the cluster without a key, so
bounded: connections served at once, a silent connection's time, and one render per TTL, on the
core's loop, however many scrapes come."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily

from scheduler_svc.telemetry import metrics_server
from scheduler_svc.telemetry.metrics_server import MAX_CONNECTIONS, CachedExposition, start_metrics_server


class Counting:
    """A collector that counts its renders and the threads they ran on."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def collect(self):
        self.threads.append(threading.get_ident())
        yield CounterMetricFamily("renders", "Renders.", value=len(self.threads))


def _registry() -> tuple[CollectorRegistry, Counting]:
    reg, counting = CollectorRegistry(), Counting()
    reg.register(counting)
    return reg, counting


def _scrape(port: int, method: bytes = b"GET") -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(method + b" /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    return got


def test_past_the_connection_cap_a_connection_is_closed_unanswered_and_the_server_recovers():
    reg, _ = _registry()
    server = start_metrics_server(0, reg, host="127.0.0.1")
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.2)  # (accepted: each holds a slot, waiting for its request)
        assert _scrape(server.port) == b""  # closed at once: no thread for it
        for s in held:
            s.close()
        deadline = time.monotonic() + 5
        while (got := _scrape(server.port)) == b"" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert got.startswith(b"HTTP/1.0 200") and b"renders_total" in got
    finally:
        for s in held:
            s.close()
        server.close()


def test_a_silent_connection_gives_its_slot_back_after_the_read_timeout(monkeypatch):
    monkeypatch.setattr(metrics_server._Quiet, "timeout", 2.0)
    reg, _ = _registry()
    server = start_metrics_server(0, reg, host="127.0.0.1")
    held = [socket.create_connection(("127.0.0.1", server.port), timeout=5) for _ in range(MAX_CONNECTIONS)]
    try:
        time.sleep(0.3)
        assert _scrape(server.port) == b""
        time.sleep(2.5)  # the silent ones timed out, though their clients never closed them
        assert _scrape(server.port).startswith(b"HTTP/1.0 200")
        assert all(s.recv(10) == b"" for s in held)  # (the server closed them)
    finally:
        for s in held:
            s.close()
        server.close()


def test_scrapes_within_the_ttl_render_once_and_head_and_get_agree():
    reg, counting = _registry()
    server = start_metrics_server(0, CachedExposition(reg, ttl_s=60.0), host="127.0.0.1")
    try:
        bodies = [_scrape(server.port).partition(b"\r\n\r\n")[2] for _ in range(20)]
        head = _scrape(server.port, b"HEAD")
        assert len(counting.threads) == 1 and len(set(bodies)) == 1
        status, _, rest = head.partition(b"\r\n")
        headers, _, body = rest.partition(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in headers.split(b"\r\n")
                      if line.lower().startswith(b"content-length"))
        assert (status.split()[1], body, length) == (b"200", b"", len(bodies[0]))
    finally:
        server.close()


def test_a_stale_text_is_rendered_on_the_loop_not_on_the_scrape_thread():
    # The collectors read what the core's loop owns (its fronts' families, its stats).
    reg, counting = _registry()
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    server = start_metrics_server(0, CachedExposition(reg, ttl_s=0.0, loop=loop), host="127.0.0.1")
    try:
        for _ in range(3):
            assert _scrape(server.port).startswith(b"HTTP/1.0 200")
        assert len(counting.threads) == 3 and set(counting.threads) == {loop_thread.ident}
    finally:
        server.close()
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(5)


@pytest.mark.parametrize("request_line,status", [(b"GET /nothing", b"404"), (b"POST /metrics", b"405")])
def test_other_paths_and_methods(request_line, status):
    reg, _ = _registry()
    server = start_metrics_server(0, reg, host="127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            s.sendall(request_line + b" HTTP/1.0\r\nHost: x\r\n\r\n")
            assert s.recv(100).split()[1] == status
    finally:
        server.close()


def test_a_request_trickled_a_byte_at_a_time_is_cut_at_the_connection_deadline(monkeypatch):
    monkeypatch.setattr(metrics_server._Quiet, "deadline_s", 1.0)
    reg, _ = _registry()
    server = start_metrics_server(0, reg, host="127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as s:
            start, cut = time.monotonic(), None
            for byte in b"GET /metrics HTTP/1.0\r\nX-Slow: " + b"a" * 100:  # each byte well within the read timeout
                try:
                    s.sendall(bytes([byte]))
                    time.sleep(0.1)
                except OSError:
                    cut = time.monotonic() - start
                    break
            if cut is None:
                assert s.recv(10) == b""  # closed by the server, though its client still sends
                cut = time.monotonic() - start
        assert 0.9 < cut < 4.0
    finally:
        server.close()
