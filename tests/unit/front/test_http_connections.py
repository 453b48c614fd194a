"""How long an HTTP peer may hold the server without using it: the real uvicorn server of the
HTTP front (scheduler_svc/front/http/serve.py) on loopback, over the fake engine, driven by raw sockets
doing what a hostile client would: trickling bytes that never make a request, stalling a TLS
handshake, while a stream producing tokens beside them is never cut."""

from __future__ import annotations

import json
import socket
import ssl
import time

import pytest

from scheduler_svc.front.http.limits import HttpLimits
from testing.grpc_fakes import FakeEngine, make_tokenizer
from testing.http_fakes import HttpThread, seconds_until_closed
from testing.tls_certs import make_pki

LIMITS = HttpLimits(keep_alive_timeout_s=1, head_timeout_s=3, tls_handshake_timeout_s=1)
NEVER = 8.0  # seconds a connection is watched before it counts as never closed


@pytest.fixture(scope="module")
def http():
    engine = FakeEngine(make_tokenizer(), 256)
    engine.ready = True
    srv = HttpThread(engine, http_limits=LIMITS)
    yield srv
    srv.stop()


def _read_response(sock: socket.socket) -> bytes:
    """One response with a Content-Length, read from a kept-alive connection: its head and body."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head


@pytest.mark.parametrize("request_", [
    b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
    # a body announced but never read (no such route): what is left of it trickles in
    b"POST /v2/nothing HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{",
], ids=["crlf-after-a-response", "unread-body-after-a-response"])
def test_bytes_that_never_make_a_request_do_not_hold_a_connection(http, request_):
    """A kept-alive connection is closed keep_alive_timeout_s after its last response whatever
    arrives, unless a request begins: a bare CRLF every 0.3 s (llhttp skips it), or the rest of
    a body nobody reads."""
    with socket.create_connection(("127.0.0.1", http.server.port), timeout=10) as sock:
        sock.sendall(request_)
        assert _read_response(sock).split(b" ")[1] in (b"200", b"404")
        trickle = b"\r\n" if request_.startswith(b"GET") else b"x"
        took = seconds_until_closed(sock, NEVER, trickle)
    assert took < LIMITS.keep_alive_timeout_s + 1.5
    assert http.request("GET", "/health")[0] == 200  # and the server serves on


def test_a_head_begun_late_still_ends_within_the_bounds(http):
    """A head that begins just before the keep-alive bound gets head_timeout_s from its first byte,
    no more, however slowly its bytes come: 408 and closed."""
    with socket.create_connection(("127.0.0.1", http.server.port), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        _read_response(sock)
        time.sleep(LIMITS.keep_alive_timeout_s - 0.5)
        start = time.monotonic()
        sock.sendall(b"GET /health HTTP/1.1\r\n")
        took = seconds_until_closed(sock, NEVER, b"X")
    assert LIMITS.head_timeout_s - 0.5 < time.monotonic() - start < LIMITS.head_timeout_s + 1.5, took


def test_a_stream_producing_tokens_outlives_the_bounds_that_close_an_idle_connection(http):
    http.engine.reset()
    http.engine.completions = ["Hello world, hello again! The quick brown fox jumps over the lazy dog."]
    http.engine.token_delay = 0.3
    body = json.dumps({"model": "tiny-test", "prompt": "Hi", "max_tokens": 16, "stream": True}).encode()
    try:
        with socket.create_connection(("127.0.0.1", http.server.port), timeout=10) as stream, \
                socket.create_connection(("127.0.0.1", http.server.port), timeout=10) as idle:
            idle.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            _read_response(idle)
            start = time.monotonic()
            stream.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n" % len(body) + body)
            events, idle_took = b"", None
            while not events.endswith(b"0\r\n\r\n"):  # the chunked response's end
                chunk = stream.recv(65536)
                assert chunk, "the stream was cut"
                events += chunk
                if idle_took is None and seconds_until_closed(idle, 0.01, b"\r\n", 0.01) < 0.01:  # CRLF each token
                    idle_took = time.monotonic() - start
            took = time.monotonic() - start
        assert took > LIMITS.keep_alive_timeout_s + LIMITS.head_timeout_s  # past either bound
        assert events.count(b"data: {") == 16 and b"data: [DONE]" in events
        assert idle_took is not None and idle_took < LIMITS.keep_alive_timeout_s + 1  # the trickler beside it: closed
    finally:
        http.engine.reset()


def test_a_tls_handshake_that_never_finishes_is_cut(tmp_path):
    pki = make_pki(tmp_path)
    engine = FakeEngine(make_tokenizer(), 256)
    engine.ready = True
    srv = HttpThread(engine, http_limits=LIMITS,
                     ssl={"ssl_certfile": str(pki["server_cert"]), "ssl_keyfile": str(pki["server_key"])})
    try:
        with socket.create_connection(("127.0.0.1", srv.server.port), timeout=10) as sock:
            sock.sendall(b"\x16\x03\x01\x02\x00\x01")  # a ClientHello record of 512 bytes, 1 sent
            took = seconds_until_closed(sock, NEVER, b"\x00")
        assert took < LIMITS.tls_handshake_timeout_s + 1.5
        ctx = ssl.create_default_context(cafile=str(pki["ca"]))
        with socket.create_connection(("127.0.0.1", srv.server.port), timeout=10) as raw, \
                ctx.wrap_socket(raw, server_hostname="localhost") as tls:  # a real client completes it
            tls.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _read_response(tls).startswith(b"HTTP/1.1 200")
    finally:
        srv.stop()
