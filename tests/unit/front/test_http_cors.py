"""CORS (--allowed-origins, front/http/cors.py): off by default; with origins, a browser's
preflight is answered before any API key is asked for, and the answers carry the headers that let
the page read them; an origin not named gets none."""

from __future__ import annotations

import http.client

import pytest
from prometheus_client import CollectorRegistry
from starlette.middleware import Middleware

from scheduler_svc.front.guards.security import ApiKeys
from scheduler_svc.front.http.auth import ApiKeyMiddleware
from scheduler_svc.front.http.cors import CorsOptions
from scheduler_svc.telemetry.metrics import Metrics
from testing.grpc_fakes import FakeEngine, make_tokenizer
from testing.http_fakes import HttpThread

KEY = "sk-cors-test"
PAGE = "https://chat.example.com"
PREFLIGHT = {"Origin": PAGE, "Access-Control-Request-Method": "POST",
             "Access-Control-Request-Headers": "authorization, content-type"}


def _call(port: int, method: str, path: str, headers: dict[str, str], body: bytes | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


@pytest.fixture()
def engine():
    e = FakeEngine(make_tokenizer(), 64)
    e.ready = True
    return e


def _server(engine, cors: CorsOptions | None) -> HttpThread:
    metrics = Metrics(CollectorRegistry())
    middleware = [cors.middleware()] if cors is not None else []
    middleware.append(Middleware(ApiKeyMiddleware, keys=ApiKeys([KEY]), throttle=None, metrics=metrics))
    return HttpThread(engine, metrics=metrics, middleware=middleware)


def test_without_allowed_origins_no_page_may_read_an_answer(engine):
    srv = _server(engine, None)
    try:
        status, headers = _call(srv.server.port, "OPTIONS", "/v1/completions", PREFLIGHT)
        assert status in (401, 405) and "access-control-allow-origin" not in headers
        status, headers = _call(srv.server.port, "GET", "/v1/models", {"Origin": PAGE, "Authorization": f"Bearer {KEY}"})
        assert status == 200 and "access-control-allow-origin" not in headers
    finally:
        srv.stop()


def test_a_named_origin_is_answered_its_preflight_before_any_key_and_reads_its_answers(engine):
    srv = _server(engine, CorsOptions((PAGE,)))
    port = srv.server.port
    try:
        status, headers = _call(port, "OPTIONS", "/v1/completions", PREFLIGHT)  # (no key: browsers send none)
        assert status == 200 and headers["access-control-allow-origin"] == PAGE
        assert "POST" in headers["access-control-allow-methods"]
        body = b'{"prompt": "Hi", "max_tokens": 2}'
        status, headers = _call(port, "POST", "/v1/completions", {"Origin": PAGE, "Content-Type": "application/json",
                                                                  "Authorization": f"Bearer {KEY}"}, body)
        assert (status, headers["access-control-allow-origin"]) == (200, PAGE)
        assert "x-request-id" in headers["access-control-expose-headers"].lower()
        status, headers = _call(port, "POST", "/v1/completions", {"Origin": PAGE, "Content-Type": "application/json"},
                                body)
        assert (status, headers["access-control-allow-origin"]) == (401, PAGE)  # the key is still required
        status, headers = _call(port, "OPTIONS", "/v1/completions", {**PREFLIGHT, "Origin": "https://evil.example"})
        assert status == 400 and "access-control-allow-origin" not in headers
        assert len(engine.requests) == 1
    finally:
        srv.stop()


def test_credentials_need_named_origins():
    with pytest.raises(ValueError, match="--allow-credentials"):
        CorsOptions(("*",), credentials=True)
    assert CorsOptions((PAGE,), credentials=True).credentials
