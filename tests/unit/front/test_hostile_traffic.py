"""Hostile traffic never reaches a benign request (issue #44): the body cap derived from the model,
413 before a body is read, the raised open-files limit, and
the connection cap answering 503 instead of a reset (large bodies in the parse worker:
test_parse_worker.py). The real uvicorn server of the HTTP front on
loopback, over the fake engine, driven by raw sockets and threads doing what an attacker would."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import msgspec
import pytest

from scheduler_svc.front.guards.request_size import ALLOWANCE_BYTES
from scheduler_svc.front.http.body_parser import BodyParser
from scheduler_svc.front.http.limits import CONNECTION_RESERVE, HttpLimits, body_cap, connection_cap
from testing.grpc_fakes import FakeEngine, make_tokenizer
from testing.http_fakes import HttpThread

MAX_MODEL_LEN = 4096


@pytest.fixture(scope="module")
def http():
    engine = FakeEngine(make_tokenizer(), MAX_MODEL_LEN)
    engine.ready = True
    srv = HttpThread(engine, http_limits=HttpLimits(max_connections=8))
    yield srv
    srv.stop()


def _status(sock: socket.socket, timeout: float = 5.0) -> int:
    sock.settimeout(timeout)
    data = b""
    while b"\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    return int(data.split(b" ", 2)[1])


def _connect(http) -> socket.socket:
    return socket.create_connection(("127.0.0.1", http.server.port), timeout=5)


def test_the_body_cap_follows_the_model_and_the_flag_wins():
    assert body_cap(HttpLimits(), 131072) == 131072 * 16 + ALLOWANCE_BYTES == 3 << 20
    assert body_cap(HttpLimits(), 4096) == 4096 * 16 + ALLOWANCE_BYTES
    assert body_cap(HttpLimits(max_body_bytes=5000), 131072) == 5000
    assert body_cap(HttpLimits(), 131072, max_in_flight_bytes=1 << 20) == 1 << 20  # never past the budget
    assert connection_cap(HttpLimits(), 1024) == 1024 - CONNECTION_RESERVE
    assert connection_cap(HttpLimits(max_connections=10), 1024) == 10
    with pytest.raises(ValueError, match="max_body_bytes must be an integer >= 0"):
        HttpLimits(max_body_bytes=-1)


def test_a_body_over_the_derived_cap_gets_413_before_it_is_sent(http):
    cap = body_cap(HttpLimits(), MAX_MODEL_LEN)
    with _connect(http) as sock:  # the head alone: the body is never sent
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (cap + 1))
        assert _status(sock) == 413
    at_cap = json.dumps({"model": "tiny-test", "prompt": "a", "user": "u" * 1000}).encode()
    status, _ = http.request("POST", "/v1/completions", at_cap)
    assert status != 413  # a body under the cap is read (and answered on its merits)


def test_a_chunked_body_gets_413_as_soon_as_it_passes_the_cap(http):
    cap = body_cap(HttpLimits(), MAX_MODEL_LEN)
    with _connect(http) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 65536
        sent = 0
        while sent <= cap:
            sock.sendall(b"%x\r\n%s\r\n" % (len(chunk), chunk))
            sent += len(chunk)
        assert _status(sock) == 413  # answered without the rest (the stream is never ended)


def test_every_process_raises_its_open_files_limit_to_the_hard_limit():
    code = ("import logging, resource; logging.basicConfig(level='INFO');"
            "from pagedserve.fd_limits import raise_open_files_limit;"
            "soft, hard = raise_open_files_limit(); print(soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1])")

    def low_soft_limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         preexec_fn=low_soft_limit, check=True)
    soft, hard = map(int, out.stdout.split())
    assert soft == min(hard, 1 << 20) > 256
    assert "soft limit" in out.stderr and "(was 256)" in out.stderr  # both numbers logged
    for main in ("scheduler_svc/__main__.py", "scheduler_svc/entrypoints/front.py",
                 "scheduler_svc/entrypoints/core.py", "executor_svc/__main__.py"):
        assert "raise_open_files_limit()" in open(main).read(), main


def test_connections_past_the_cap_get_503_and_health_probes_still_pass(http):
    held = [_connect(http) for _ in range(10)]  # past the cap of 8: idle, as a flood holds them
    try:
        time.sleep(0.2)
        with _connect(http) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n{}")
            assert _status(sock) == 503
        with _connect(http) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _status(sock) == 200
        more = [_connect(http) for _ in range(CONNECTION_RESERVE // 2)]  # past the cap and half the reserve
        try:
            time.sleep(0.2)
            with _connect(http) as sock:  # answered at once, before it sends anything, then closed
                assert _status(sock) == 503
        finally:
            for s in more:
                s.close()
    finally:
        for s in held:
            s.close()
    time.sleep(0.2)
    status, _ = http.request("GET", "/health")
    assert status == 200


@pytest.fixture
def open_http():
    engine = FakeEngine(make_tokenizer(), MAX_MODEL_LEN)
    engine.ready = True
    srv = HttpThread(engine)  # every limit derived
    yield srv
    srv.stop()


def test_a_benign_request_is_served_promptly_while_large_bodies_flood_in(open_http):
    """Ten bodies of token ids near the cap, posted together and again, while a benign completion
    repeats: the benign one's worst latency stays far below ten decodes' worth of queueing."""
    http = open_http
    cap = body_cap(HttpLimits(), MAX_MODEL_LEN)
    ids = list(range(100_000, 100_000 + cap // 8))  # longer than the model: a 400, after the decode
    body = msgspec.json.encode({"model": "tiny-test", "prompt": ids})
    assert BodyParser().large_bytes < len(body) < cap
    benign = {"model": "tiny-test", "prompt": "hello", "max_tokens": 2}

    def timed() -> float:
        start = time.perf_counter()
        status, _ = http.request("POST", "/v1/completions", benign)
        assert status == 200
        return time.perf_counter() - start

    idle = min(timed() for _ in range(5))
    stop = threading.Event()
    statuses: list[int] = []

    def attack() -> None:
        while not stop.is_set():
            statuses.append(http.request("POST", "/v1/completions", body)[0])

    attackers = [threading.Thread(target=attack) for _ in range(10)]
    for t in attackers:
        t.start()
    try:
        time.sleep(0.3)
        worst = max(timed() for _ in range(10))
    finally:
        stop.set()
        for t in attackers:
            t.join(30)
    assert statuses and set(statuses) <= {400, 503}, set(statuses)  # too long for the model, or the queue full
    print(f"benign worst {worst:.4f}s, idle {idle:.4f}s")
    assert worst <= max(1.0, 20 * idle), f"benign worst {worst:.3f}s against idle {idle:.4f}s"


def test_a_grpc_message_larger_than_the_model_can_need_is_refused_unparsed():
    """Over the derived cap (max_model_len x 16 + 1 MiB): RESOURCE_EXHAUSTED naming the cap, before
    a parse that would grow 1-byte ids into a 4-byte array; under it, a prompt longer than the
    model is parsed and refused from its length (INVALID_ARGUMENT)."""
    import grpc

    from pagedserve.v1 import generation_pb2 as pb
    from pagedserve.v1 import generation_pb2_grpc as pb_grpc
    from scheduler_svc.front.guards.request_size import request_bytes_for
    from testing.grpc_fakes import ServerThread

    engine = FakeEngine(make_tokenizer(), max_model_len=64)
    engine.ready = True
    srv = ServerThread(engine)
    try:
        with grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            cap = request_bytes_for(64)

            def code_of(n_ids: int) -> tuple[grpc.StatusCode, str]:
                req = pb.GenerateRequest(prompt_token_ids=[7] * n_ids, sampling=pb.SamplingParams(max_tokens=1))
                with pytest.raises(grpc.RpcError) as e:
                    list(stub.Generate(req, timeout=20))
                return e.value.code(), e.value.details()

            code, details = code_of(cap + 10)  # one byte per id: just over the cap
            assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"at most {cap}" in details
            code, details = code_of(cap // 2)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "maximum context length is 64" in details
    finally:
        srv.stop()


def test_grpc_core_refuses_a_message_longer_than_the_model_config_allows_from_its_length(tmp_path):
    """grpc.max_receive_message_length follows the model's config (known at start): a longer
    message is refused by grpc core from its length prefix, RESOURCE_EXHAUSTED."""
    import grpc

    from pagedserve.model_dir import max_positions
    from pagedserve.v1 import generation_pb2 as pb
    from pagedserve.v1 import generation_pb2_grpc as pb_grpc
    from scheduler_svc.front.grpc.limits import MAX_REQUEST_BYTES, max_receive_bytes
    from scheduler_svc.front.guards.request_size import request_bytes_for
    from testing.grpc_fakes import ServerThread

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096}')
    assert max_positions(tmp_path) == 4096
    (tmp_path / "config.json").write_text('{"max_position_embeddings": "long"}')
    assert max_positions(tmp_path) is None
    assert max_receive_bytes(None) == MAX_REQUEST_BYTES == max_receive_bytes(1 << 20)
    assert max_receive_bytes(4096) == request_bytes_for(4096) < MAX_REQUEST_BYTES
    engine = FakeEngine(make_tokenizer(), max_model_len=64)
    engine.ready = True
    srv = ServerThread(engine, max_message_bytes=max_receive_bytes(64))
    try:
        with grpc.insecure_channel(srv.address) as channel:
            req = pb.GenerateRequest(prompt_token_ids=[7] * (max_receive_bytes(64) + 10))
            with pytest.raises(grpc.RpcError) as e:
                list(pb_grpc.GenerationStub(channel).Generate(req, timeout=20))
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in e.value.details()
    finally:
        srv.stop()


def test_a_closed_connection_keeps_no_unread_body_until_a_collection(open_http):
    """A body refused with 413 still arrives; the bytes uvicorn buffered for it must go with the
    connection, not wait for the cyclic collector (the protocol and its request cycle refer to
    each other): with the collector off, no request cycle still holds body bytes."""
    import gc

    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    cap = body_cap(HttpLimits(), MAX_MODEL_LEN)
    gc.collect()
    gc.disable()
    try:
        for _ in range(10):
            with _connect(open_http) as sock:
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (cap + 1))
                try:
                    sock.sendall(b"1," * (256 << 10))
                except OSError:
                    pass
                assert _status(sock) == 413
        time.sleep(0.3)  # the server sees the connections close
        held = [c for c in gc.get_objects() if isinstance(c, RequestResponseCycle) and c.body]
        assert not held, f"{len(held)} request cycles still hold {sum(len(c.body) for c in held)} body bytes"
    finally:
        gc.enable()


def test_grpc_connections_past_the_cap_fail_unavailable_and_the_rest_are_served():
    import grpc

    from pagedserve.v1 import generation_pb2 as pb
    from pagedserve.v1 import generation_pb2_grpc as pb_grpc
    from scheduler_svc.front.grpc.limits import GrpcLimits, server_options
    from testing.grpc_fakes import ServerThread

    assert ("grpc.max_allowed_incoming_connections", 10) in server_options(GrpcLimits(max_connections=10))
    engine = FakeEngine(make_tokenizer(), max_model_len=64)
    engine.ready = True
    srv = ServerThread(engine, grpc_limits=GrpcLimits(max_connections=4))
    req = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2))

    def call() -> grpc.StatusCode:
        with grpc.insecure_channel(srv.address) as channel:
            try:
                list(pb_grpc.GenerationStub(channel).Generate(req, timeout=10))
                return grpc.StatusCode.OK
            except grpc.RpcError as e:
                return e.code()

    try:
        host, port = srv.address.split(":")
        held = [socket.create_connection((host, int(port))) for _ in range(4)]  # a flood holding the cap
        time.sleep(0.3)
        assert call() == grpc.StatusCode.UNAVAILABLE  # closed at once: no descriptor left to a reset
        for s in held:
            s.close()
        time.sleep(0.5)
        assert call() == grpc.StatusCode.OK
    finally:
        srv.stop()
