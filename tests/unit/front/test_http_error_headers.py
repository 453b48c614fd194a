"""The headers and codes of the HTTP front's refusals: a 405 lists the route's methods (``Allow``,
RFC 9110) and has a code as the 404 has; a 429 or 503 whose cause passes by itself (a full queue,
no executor) carries ``Retry-After`` as the call budget's 429 does; the 503 without a model says
whether an executor ever came or the last one left."""

from __future__ import annotations

import http.client
import json

import pytest

from testing.grpc_fakes import FakeEngine, make_tokenizer
from testing.http_fakes import HttpThread

NEVER = "no executor has registered yet; retry later"
LEFT = "no executor is connected now (the last one left); retry once one has registered"


@pytest.fixture(scope="module")
def server():
    srv = HttpThread(FakeEngine(make_tokenizer(), 256))
    yield srv
    srv.stop()


@pytest.fixture()
def fake(server):
    return server.fresh()


def _send(srv: HttpThread, method: str, path: str, body: dict | None = None) -> tuple[int, dict[str, str], dict]:
    """(status, headers by lower-case name, the error body's ``error``, or a success's body)."""
    conn = http.client.HTTPConnection("127.0.0.1", srv.server.port, timeout=10)
    try:
        conn.request(method, path, body=json.dumps(body).encode() if body is not None else None,
                     headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        raw = resp.read()
        body = json.loads(raw)
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body.get("error", body)
    finally:
        conn.close()


def test_a_405_lists_the_routes_methods_and_has_a_code(fake):
    status, headers, err = _send(fake, "GET", "/v1/completions")
    assert (status, headers["allow"], err["code"]) == (405, "POST", "method_not_allowed")
    status, headers, err = _send(fake, "DELETE", "/ping")
    assert (status, err["code"]) == (405, "method_not_allowed")
    assert set(headers["allow"].split(", ")) == {"GET", "HEAD", "POST"}  # (Starlette adds HEAD to GET)
    status, headers, err = _send(fake, "GET", "/v2/nothing")
    assert (status, err["code"]) == (404, "not_found") and "allow" not in headers


@pytest.mark.parametrize("mode,status,code", [("queue_full", 429, "queue_full"), ("no_executor", 503, "no_executor")])
@pytest.mark.parametrize("stream", [False, True])
def test_a_full_queue_or_no_executor_says_when_to_retry(fake, mode, status, code, stream):
    fake.engine.mode = mode
    got, headers, err = _send(fake, "POST", "/v1/completions", {"prompt": "a", "stream": stream})
    assert (got, headers.get("retry-after"), err["code"]) == (status, "1", code)


def test_an_engine_failure_says_nothing_of_retrying(fake):
    fake.engine.mode = "crash"  # (after the first output: a whole response fails with 500)
    status, headers, err = _send(fake, "POST", "/v1/completions", {"prompt": "a"})
    assert (status, err["code"]) == (500, "internal_error") and "retry-after" not in headers


def test_without_a_model_the_503_says_whether_an_executor_ever_came():
    engine = FakeEngine(make_tokenizer(), 256)
    info, engine.info = engine.info, None
    srv = HttpThread(engine)
    try:
        for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models")):
            status, headers, err = _send(srv, method, path, {"prompt": "a"} if method == "POST" else None)
            assert (status, headers.get("retry-after"), err["code"], err["message"]) == (503, "1", "no_executor", NEVER)
        engine.info = info  # an executor registers, and the front serves its model
        assert _send(srv, "POST", "/v1/completions", {"prompt": "a"})[0] == 200
        engine.info = None  # the last executor left
        status, headers, err = _send(srv, "POST", "/v1/completions", {"prompt": "a"})
        assert (status, headers.get("retry-after"), err["code"], err["message"]) == (503, "1", "no_executor", LEFT)
        # /v1/models still lists the model served (a client's model picker across an executors' restart)
        status, _, body = _send(srv, "GET", "/v1/models")
        assert status == 200 and [m["id"] for m in body["data"]] == [info.model_name]
    finally:
        srv.stop()
