"""What the public fronts hold at once, and failed API keys per peer: the shared CallBudget and
AuthThrottle on their own, then on real servers (gRPC and HTTP, over the fake engine) on loopback,
where over-cap callers are refused before their request is read while the calls in progress,
another peer and health checks are served."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import time
from unittest import mock

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client import CollectorRegistry
from starlette.middleware import Middleware

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.front.grpc.limits import MAX_REQUEST_BYTES, GrpcLimits
from scheduler_svc.front.guards.admission import CallBudget, Shed, Ticket, sized_for_machine
from scheduler_svc.front.guards.auth_throttle import AuthThrottle, peer_of_grpc, peer_of_host
from scheduler_svc.front.guards.security import ApiKeys
from scheduler_svc.front.http.auth import ApiKeyMiddleware
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.telemetry.metrics import Metrics
from testing import h2_raw
from testing.grpc_fakes import FakeEngine, ServerThread, make_tokenizer
from testing.http_fakes import HttpThread
from testing.tcp_relay import Relay
from testing.waits import wait_for

MiB, GiB = 1 << 20, 1 << 30
KEY = "key-for-the-tests-0123456789"
GENERATE = "/pagedserve.v1.Generation/Generate"
LONG = "Hello world, hello again! The quick brown fox jumps over the lazy dog. " * 3


# ------------------------------------------------------------------ the pieces

def test_a_budget_refuses_past_either_cap_and_takes_back_what_a_call_held():
    budget = CallBudget(max_calls=2, max_bytes=100)
    a, b = budget.enter(60), budget.enter()
    with pytest.raises(Shed) as e:
        budget.enter()
    assert e.value.reason == "max_concurrent_calls" and "--max-concurrent-calls (2)" in str(e.value)
    with pytest.raises(Shed) as e:
        b.charge(41)  # 60 + 41 > 100: nothing charged
    assert e.value.reason == "max_in_flight_bytes" and "this request has 41" in str(e.value)
    b.charge(40)
    assert (budget.calls, budget.bytes) == (2, 100)
    a.release()
    a.release()  # idempotent
    assert (budget.calls, budget.bytes) == (1, 40)
    b.release()
    assert (budget.calls, budget.bytes) == (0, 0)


@pytest.mark.parametrize("memory,cpus,calls,in_flight", [
    (2 * GiB, 2, 2048, 256 * MiB),  # a small pod: memory and CPU agree
    (2 * GiB, 0.5, 512, 256 * MiB),  # half a CPU (a cgroup quota)
    (128 * GiB, 64, 16384, 1 * GiB),  # a large machine: the upper ends
    (256 * MiB, 1, 256, 64 * MiB),  # a tiny one: the lower ends
])
def test_caps_given_as_zero_are_sized_for_the_machine(memory, cpus, calls, in_flight):
    sized = sized_for_machine(ServerLimits(), memory_bytes=memory, cpus=cpus)
    assert (sized.max_concurrent_calls, sized.max_in_flight_bytes) == (calls, in_flight)
    given = ServerLimits(max_concurrent_calls=7, max_in_flight_bytes=9 * MiB)
    assert sized_for_machine(given, memory_bytes=memory, cpus=cpus) == given


def test_the_throttle_allows_a_burst_then_one_attempt_per_refill_and_forgets_refilled_peers():
    now = [0.0]
    throttle = AuthThrottle(burst=3, refill_s=10, clock=lambda: now[0])
    for _ in range(3):
        assert throttle.wait_s("1.2.3.4") == 0
        throttle.failed("1.2.3.4")
    assert throttle.wait_s("1.2.3.4") == pytest.approx(10)
    assert throttle.wait_s("5.6.7.8") == 0  # another peer is not affected
    now[0] = 4.0
    assert throttle.wait_s("1.2.3.4") == pytest.approx(6)
    now[0] = 10.0
    assert throttle.wait_s("1.2.3.4") == 0  # one attempt regained
    throttle.failed("1.2.3.4")
    assert throttle.wait_s("1.2.3.4") == pytest.approx(10)
    now[0] = 40.0  # refilled: the peer is forgotten
    assert throttle.wait_s("1.2.3.4") == 0 and len(throttle) == 0


def test_the_throttle_table_stays_bounded_whatever_addresses_a_client_rotates_through():
    throttle = AuthThrottle(burst=2, refill_s=60, max_peers=100)
    for i in range(10_000):
        throttle.failed(peer_of_host(f"10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}"))
    assert len(throttle) == 100
    for i in range(10_000):  # an IPv6 client rotating through its /64 is one peer
        throttle.failed(peer_of_host(f"2001:db8::{i:x}"))
    assert throttle.wait_s(peer_of_host("2001:db8::ffff:1")) > 0 and len(throttle) == 100


@pytest.mark.parametrize("grpc_peer,key", [
    ("ipv4:10.1.2.3:5678", "10.1.2.3"), ("ipv6:[::1]:5678", "::/64"), ("ipv6:%5B2001:db8::7%5D:1", "2001:db8::/64"),
    ("ipv6:[::ffff:10.1.2.3]:9", "10.1.2.3"), ("unix:/tmp/sock", "unix"),
])
def test_peers_are_keyed_by_address_without_the_port(grpc_peer, key):
    assert peer_of_grpc(grpc_peer) == key


# ------------------------------------------------------------------ gRPC

def _greq(prompt: str = "Hi", max_tokens: int = 16) -> pb.GenerateRequest:
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def _code(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value


def _shed(metrics: Metrics, reason: str) -> float:
    return metrics.shed.labels(reason)._value.get()


@pytest.fixture()
def slow_engine():
    engine = FakeEngine(make_tokenizer(), max_model_len=4096)
    engine.ready = True
    engine.completions = [LONG]
    engine.token_delay = 0.05
    return engine


def test_grpc_calls_over_the_cap_are_refused_while_the_calls_in_progress_complete(slow_engine):
    metrics = Metrics(CollectorRegistry())
    srv = ServerThread(slow_engine, metrics=metrics, budget=CallBudget(max_calls=2, max_bytes=64 * MiB))
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            running = [stub.Generate(_greq(), timeout=30) for _ in range(2)]
            for r in running:
                next(r)  # both in progress
            err = _code(lambda: list(stub.Generate(_greq(), timeout=10)))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "--max-concurrent-calls (2)" in err.details()
            assert _code(lambda: stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)).code() \
                == grpc.StatusCode.RESOURCE_EXHAUSTED
            health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # probes pass at the cap
            for r in running:  # the calls in progress run to their end
                assert sum(len(c.token_ids) for m in r for c in m.choices) == 15
            assert len(list(stub.Generate(_greq(), timeout=30))) == 16  # their slots came back
        assert _shed(metrics, "max_concurrent_calls") == 2
        assert metrics.rejected.labels("RESOURCE_EXHAUSTED")._value.get() == 2
    finally:
        srv.stop()


def test_grpc_request_bytes_over_the_cap_are_refused_before_they_are_read(slow_engine):
    """A gRPC message's size is known only once it has arrived, so a call is read only when the
    budget has room for a message of the largest size (4 MiB); then only its own size is kept."""
    metrics = Metrics(CollectorRegistry())
    budget = CallBudget(max_calls=100, max_bytes=MAX_REQUEST_BYTES + 1000)
    srv = ServerThread(slow_engine, metrics=metrics, budget=budget)
    try:
        with grpc.insecure_channel(srv.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            running = stub.Generate(_greq("Hello " * 330), timeout=30)  # ~2 KB: 1000 bytes from room for 4 MiB
            next(running)
            assert 1980 < budget.bytes < 2100 and budget.reserved == 0
            err = _code(lambda: list(stub.Generate(_greq(), timeout=10)))
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"--max-in-flight-bytes ({MAX_REQUEST_BYTES + 1000})" in err.details()
            assert sum(len(c.token_ids) for m in running for c in m.choices) == 15  # the call in progress ends
            assert len(list(stub.Generate(_greq(), timeout=30))) == 16  # and its bytes came back
        wait_for(lambda: (budget.calls, budget.bytes) == (0, 0), 10, "the calls to give their budget back")
        assert _shed(metrics, "max_in_flight_bytes") == 1
        assert len(slow_engine.requests) == 2  # the refused one never reached validation or the engine
    finally:
        srv.stop()


def test_a_burst_of_small_grpc_calls_waits_for_room_instead_of_being_refused(slow_engine):
    """Thirty calls at once, room for one message of the largest size (and the small ones held):
    the reservation of the read in progress shrinks to its message's size within moments, and the
    others wait for it."""
    budget = CallBudget(max_calls=100, max_bytes=MAX_REQUEST_BYTES + 64 * 1024)
    srv = ServerThread(slow_engine, budget=budget)
    waited = []
    reserve = Ticket.reserve
    another_waits = asyncio.Event()  # (used on the server's loop only)

    async def counting(ticket, nbytes):
        found_taken = ticket.budget.bytes + nbytes > ticket.budget.max_bytes
        waited.append(found_taken)
        if found_taken:
            another_waits.set()
        await reserve(ticket, nbytes)
        if len(waited) == 1:  # the first read is slow: its reservation stands until another call meets it
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(another_waits.wait(), 10)

    async def burst() -> list[int]:
        async with grpc.aio.insecure_channel(srv.address) as ch:
            stub = pb_grpc.GenerationStub(ch)

            async def one(i: int) -> int:
                return len([r async for r in stub.Generate(_greq(f"call {i}", max_tokens=2), timeout=30)])

            return await asyncio.gather(*(one(i) for i in range(30)))

    try:
        with mock.patch.object(Ticket, "reserve", counting):
            counts = asyncio.run(burst())
        assert counts == [2] * 30 and any(waited)  # some found the room reserved, and waited
        wait_for(lambda: (budget.calls, budget.bytes, budget.reserved) == (0, 0, 0), 10,
                 "the calls to give their budget back")
    finally:
        srv.stop()


def test_a_grpc_call_waiting_for_room_cannot_push_its_message_meanwhile(slow_engine):
    """grpc core buffers what a call's receive window lets in before the gate reads it: the
    server keeps that window at HTTP/2's 64 KiB (no BDP probing), not grpc's 4 MiB."""
    budget = CallBudget(max_calls=100, max_bytes=MAX_REQUEST_BYTES)
    srv = ServerThread(slow_engine, budget=budget, grpc_limits=GrpcLimits(message_timeout_s=5))
    try:
        with h2_raw.connect(srv.api.port) as holder, h2_raw.connect(srv.api.port) as pusher:
            holder.sendall(h2_raw.grpc_headers(GENERATE))  # reads its message: all the room is reserved
            deadline = time.monotonic() + 5
            while budget.reserved < MAX_REQUEST_BYTES:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            pusher.sendall(h2_raw.grpc_headers(GENERATE))  # waits for room, unread
            accepted = h2_raw.send_message(pusher, b"x" * MiB, seconds=1.0)
        assert accepted <= 65535  # 4 MiB with grpc's BDP-sized window
    finally:
        srv.stop()


def test_grpc_key_guessing_is_throttled_per_peer_while_another_peer_is_served(slow_engine):
    metrics = Metrics(CollectorRegistry())
    throttle = AuthThrottle(burst=3, refill_s=60)
    srv = ServerThread(slow_engine, metrics=metrics, api_keys=ApiKeys([KEY]), throttle=throttle,
                       budget=CallBudget(100, 64 * MiB))
    relay = Relay(srv.api.port)  # the same client, seen from another address
    try:
        with grpc.insecure_channel(srv.address) as guesser, grpc.insecure_channel(f"127.0.0.1:{relay.port}") as other:
            stub = pb_grpc.GenerationStub(guesser)

            def guess(key: str) -> grpc.RpcError:
                return _code(lambda: list(stub.Generate(_greq(), metadata=[("authorization", f"Bearer {key}")],
                                                        timeout=10)))

            assert [guess(f"wrong-{i}").code() for i in range(3)] == [grpc.StatusCode.UNAUTHENTICATED] * 3
            err = guess(KEY)  # locked out: not even the right key is checked
            assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "retry in 60s" in err.details()
            assert guess("wrong-4").code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            health = health_pb2_grpc.HealthStub(guesser).Check(health_pb2.HealthCheckRequest(), timeout=10)
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            served = list(pb_grpc.GenerationStub(other).Generate(
                _greq(), metadata=[("authorization", f"Bearer {KEY}")], timeout=30))
            assert len(served) == 16
        assert len(throttle) == 1 and _shed(metrics, "auth_throttled") == 2
        assert metrics.rejected.labels("UNAUTHENTICATED")._value.get() == 3
        assert metrics.rejected.labels("RESOURCE_EXHAUSTED")._value.get() == 2
    finally:
        relay.close()
        srv.stop()


# ------------------------------------------------------------------ HTTP

def _post(port: int, body: bytes, headers: dict[str, str] | None = None,
          source: str = "127.0.0.1") -> tuple[int, dict, dict[str, str]]:
    """POST /v1/completions over a new connection from ``source``: (status, JSON body, headers)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10, source_address=(source, 0))
    try:
        conn.request("POST", "/v1/completions", body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}"), {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


def _raw_response(sock: socket.socket) -> tuple[int, dict]:
    """(status, JSON body) of one response with a Content-Length."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(v) for k, _, v in (line.partition(b":") for line in head.split(b"\r\n"))
                  if k.lower() == b"content-length")
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), json.loads(body)


def _completion(prompt: str = "Hi") -> bytes:
    return json.dumps({"model": "tiny-test", "prompt": prompt, "max_tokens": 16, "ignore_eos": True}).encode()


def test_http_calls_over_the_cap_get_429_while_the_calls_in_progress_complete(slow_engine):
    metrics = Metrics(CollectorRegistry())
    srv = HttpThread(slow_engine, metrics=metrics, budget=CallBudget(max_calls=2, max_bytes=MiB))
    try:
        client = srv.client(timeout=30)
        running = [client.completions.create(model="tiny-test", prompt="Hi", max_tokens=16, stream=True,
                                             extra_body={"ignore_eos": True}) for _ in range(2)]
        chunks = [iter(r) for r in running]
        for c in chunks:
            next(c)
        status, body, headers = _post(srv.server.port, _completion())
        assert status == 429 and body["error"]["code"] == "max_concurrent_calls" and headers["retry-after"] == "1"
        assert srv.request("GET", "/health")[0] == 200  # probes pass at the cap
        for c in chunks:
            assert len(list(c)) == 15
        assert client.completions.create(model="tiny-test", prompt="Hi", max_tokens=4).usage.completion_tokens == 4
        assert _shed(metrics, "max_concurrent_calls") == 1
        assert metrics.rejected.labels("RESOURCE_EXHAUSTED")._value.get() == 1
    finally:
        srv.stop()


def test_http_request_bytes_over_the_cap_get_429_before_the_body_is_read(slow_engine):
    metrics = Metrics(CollectorRegistry())
    budget = CallBudget(max_calls=100, max_bytes=3000)
    srv = HttpThread(slow_engine, metrics=metrics, budget=budget)
    big = _completion("Hello " * 330)  # ~2 KB bodies: one fits, two do not
    try:
        stream = srv.client(timeout=30).completions.create(model="tiny-test", prompt="Hello " * 330, max_tokens=16,
                                                           stream=True, extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        with socket.create_connection(("127.0.0.1", srv.server.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n" % len(big))  # the head only: refused from it
            status, body = _raw_response(sock)
        assert status == 429 and body["error"]["code"] == "max_in_flight_bytes"
        with socket.create_connection(("127.0.0.1", srv.server.port), timeout=10) as sock:  # no Content-Length
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n")
            for i in range(0, len(big), 500):
                part = big[i:i + 500]
                sock.sendall(b"%x\r\n" % len(part) + part + b"\r\n")
            status, body = _raw_response(sock)
        assert status == 429 and body["error"]["code"] == "max_in_flight_bytes"
        assert _post(srv.server.port, _completion())[0] == 200  # a request that fits runs
        assert len(list(chunks)) == 15
        wait_for(lambda: (budget.calls, budget.bytes) == (0, 0), 10, "the stream's call to give its budget back")
        assert _shed(metrics, "max_in_flight_bytes") == 2
        assert len(slow_engine.requests) == 2  # the refused ones never reached the engine
    finally:
        srv.stop()


def test_http_key_guessing_is_throttled_per_peer_while_another_peer_is_served(slow_engine):
    metrics = Metrics(CollectorRegistry())
    throttle = AuthThrottle(burst=3, refill_s=60)
    srv = HttpThread(slow_engine, metrics=metrics,
                     middleware=[Middleware(ApiKeyMiddleware, keys=ApiKeys([KEY]), throttle=throttle, metrics=metrics)])
    port = srv.server.port
    try:
        # each guess over a new connection (a new source port): still the same peer
        statuses = [_post(port, _completion(), {"Authorization": f"Bearer wrong-{i}"})[0] for i in range(3)]
        assert statuses == [401] * 3
        status, body, headers = _post(port, _completion(), {"Authorization": f"Bearer {KEY}"})
        assert status == 429 and body["error"]["code"] == "too_many_failed_api_keys"
        assert headers["retry-after"] == "60"
        assert srv.request("GET", "/health")[0] == srv.request("GET", "/ping")[0] == 200  # probes stay open
        status, body, _ = _post(port, _completion(), {"Authorization": f"Bearer {KEY}"}, source="127.0.0.2")
        assert status == 200 and body["usage"]["completion_tokens"] == 16
        assert len(throttle) == 1 and _shed(metrics, "auth_throttled") == 1
        assert metrics.rejected.labels("UNAUTHENTICATED")._value.get() == 3
    finally:
        srv.stop()


def test_the_openai_client_sees_a_rate_limit_error(slow_engine):
    srv = HttpThread(slow_engine, budget=CallBudget(max_calls=1, max_bytes=MiB))
    try:
        client = srv.client(timeout=30)
        stream = client.completions.create(model="tiny-test", prompt="Hi", max_tokens=16, stream=True)
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model="tiny-test", prompt="Hi", max_tokens=2)
        assert err.value.status_code == 429 and err.value.body["type"] == "rate_limit_error"
        stream.close()
    finally:
        srv.stop()
