"""How long a gRPC peer may hold the server without using it: a real grpc.aio server on loopback,
driven by grpc's own client and by a raw HTTP/2 peer (h2_raw.py) doing what grpc's client never
would. Each bound is one grpc core argument or the call gate (scheduler_svc/front/grpc/limits.py);
grpc core ignores arguments it does not know, so each is checked here, against the wire."""

from __future__ import annotations

import contextlib
import threading
import time

import grpc
import pytest

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.front.grpc.limits import GrpcLimits
from scheduler_svc.front.guards.security import TlsFiles
from testing import h2_raw
from testing.grpc_fakes import FakeEngine, ServerThread, make_tokenizer
from testing.tls_certs import make_pki

GENERATE = "/pagedserve.v1.Generation/Generate"
# Small bounds, each a different number of seconds, so a closure is told apart by when it happens.
LIMITS = GrpcLimits(handshake_timeout_s=1, idle_timeout_s=2, message_timeout_s=1, keepalive_s=3,
                    max_connection_age_s=2)
NEVER = 8.0  # seconds a connection is watched before it counts as never closed (grpc's defaults: minutes)


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(make_tokenizer())
    engine.ready = True
    srv = ServerThread(engine, grpc_limits=LIMITS)
    yield srv
    srv.stop()


@pytest.fixture()
def engine(server):
    server.engine.reset()
    return server.engine


@pytest.mark.parametrize("trickle", [h2_raw.window_update(), h2_raw.frame(h2_raw.SETTINGS, 0, 0)],
                         ids=["window-updates", "settings"])
def test_a_connection_without_calls_is_closed_whatever_frames_trickle_in(server, trickle):
    with h2_raw.connect(server.api.port) as sock:
        took = h2_raw.seconds_until_closed(sock, NEVER, trickle, every_s=0.3)
    assert LIMITS.idle_timeout_s - 0.5 < took < LIMITS.idle_timeout_s + 2


def test_a_ping_flood_is_closed_before_the_idle_bound(server):
    """Keep-alive enforcement: pings without calls more often than every 5 minutes are strikes."""
    with h2_raw.connect(server.api.port) as sock:
        took = h2_raw.seconds_until_closed(sock, NEVER, h2_raw.frame(h2_raw.PING, 0, 0, b"12345678"), every_s=0.1)
    assert took < LIMITS.idle_timeout_s - 0.5


@pytest.mark.parametrize("every_s", [None, 0.4], ids=["silent", "preface-a-byte-at-a-time"])
def test_a_connection_must_finish_its_preface_within_the_handshake_bound(server, every_s):
    with h2_raw.connect(server.api.port, settings=False) as sock:
        start = time.monotonic()
        if every_s is not None:  # the preface, in order, one byte each every_s (whole after 9.6 s)
            with contextlib.suppress(OSError):
                for i in range(len(h2_raw.PREFACE)):
                    sock.sendall(h2_raw.PREFACE[i:i + 1])
                    if h2_raw.seconds_until_closed(sock, every_s, ack_settings=False) < every_s:
                        break
        else:
            h2_raw.seconds_until_closed(sock, NEVER, ack_settings=False)
        took = time.monotonic() - start
    assert took < LIMITS.handshake_timeout_s + 2


def test_a_tls_handshake_that_never_finishes_is_cut(tmp_path):
    pki = make_pki(tmp_path)
    engine = FakeEngine(make_tokenizer())
    engine.ready = True
    srv = ServerThread(engine, grpc_limits=LIMITS, tls=TlsFiles(pki["server_cert"], pki["server_key"]))
    try:
        with h2_raw.connect(srv.api.port, settings=False) as sock:
            sock.sendall(b"\x16\x03\x01\x02\x00\x01")  # a ClientHello record of 512 bytes, 1 sent
            took = h2_raw.seconds_until_closed(sock, NEVER, b"\x00", every_s=0.3, ack_settings=False)
        assert took < LIMITS.handshake_timeout_s + 2
        creds = grpc.ssl_channel_credentials(pki["ca"].read_bytes())
        with grpc.secure_channel(f"localhost:{srv.api.port}", creds) as ch:  # a real client completes it
            assert pb_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model_name
    finally:
        srv.stop()


@pytest.mark.parametrize("method", [GENERATE, "/grpc.health.v1.Health/Check",
                                    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo"],
                         ids=["generate", "health", "reflection-stream"])
def test_a_request_message_that_never_arrives_ends_the_call(server, method):
    """Health checks skip the key and the budget, not this; a request-streaming method (reflection)
    must get each message in time."""
    gate = threading.Event()

    def never():  # grpc's client sends the call's headers, then waits for a message that never comes
        gate.wait()
        yield from ()

    with grpc.insecure_channel(server.address) as ch:
        start = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            list(ch.stream_stream(method)(never(), timeout=NEVER))
        gate.set()
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
        assert "--grpc-message-timeout-s" in err.value.details()
        assert time.monotonic() - start < LIMITS.message_timeout_s + 1.5


def test_a_request_message_that_never_completes_ends_the_call_and_then_the_connection(server):
    with h2_raw.connect(server.api.port) as sock:  # by hand: 10 bytes of a message of 100, frames after
        sock.sendall(h2_raw.grpc_headers(GENERATE) + h2_raw.frame(h2_raw.DATA, 0, 1, b"\x00\x00\x00\x00\x64" + b"x" * 5))
        took = h2_raw.seconds_until_closed(sock, NEVER, h2_raw.window_update(), every_s=0.3)
    assert took < LIMITS.message_timeout_s + LIMITS.idle_timeout_s + 2


def test_a_stream_producing_tokens_outlives_idle_and_age_bounds_that_close_an_idle_connection(server, engine):
    engine.completions = ["Hello world, hello again! The quick brown fox jumps over the lazy dog."]
    engine.token_delay = 0.3
    with grpc.insecure_channel(server.address) as ch, h2_raw.connect(server.api.port) as idle:
        stub = pb_grpc.GenerationStub(ch)
        start = time.monotonic()
        responses = list(stub.Generate(pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=16)),
                                       timeout=30))
        took = time.monotonic() - start
        idle_took = h2_raw.seconds_until_closed(idle, 0.5)
        assert took > LIMITS.max_connection_age_s + LIMITS.idle_timeout_s  # ran past both bounds
        assert sum(len(c.token_ids) for r in responses for c in r.choices) == 16
        assert responses[-1].choices[0].finish_reason == pb.FINISH_REASON_LENGTH
        assert idle_took < 0.5  # while the idle connection beside it had been closed
        # The connection got GOAWAY at its age: the next call goes over a new one.
        assert stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).model_name


def test_a_peer_that_leaves_pings_unanswered_is_closed_with_its_stream(server, engine):
    """A client gone without a FIN holds its stream until a ping goes unanswered (keepalive_s / 3)."""
    engine.mode = "endless"
    with h2_raw.connect(server.api.port) as sock:
        request = pb.GenerateRequest(prompt="Hi").SerializeToString()
        sock.sendall(h2_raw.grpc_headers(GENERATE) + h2_raw.grpc_message(request))
        took = h2_raw.seconds_until_closed(sock, NEVER)  # reads, never answers a PING
    assert took < LIMITS.keepalive_s / 3 + LIMITS.keepalive_s + 1
    deadline = time.monotonic() + 5
    while not engine.closed:  # and the engine was told to abort the request
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_peer_may_hold_only_a_few_health_checks_waiting_for_their_message():
    """Health checks carry no key and take no budget: a peer that opens many and never sends their
    message is refused past MAX_OPEN_READS_PER_PEER (each would hold up to a whole message in grpc
    core), while a probe whose message comes at once is served before and after."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from scheduler_svc.front.grpc.call_gate import MAX_OPEN_READS_PER_PEER

    engine = FakeEngine(make_tokenizer())
    engine.ready = True
    limits = GrpcLimits(handshake_timeout_s=5, idle_timeout_s=30, message_timeout_s=4, keepalive_s=30,
                        max_connection_age_s=60)
    srv = ServerThread(engine, grpc_limits=limits)
    gate = threading.Event()
    codes: list[grpc.StatusCode] = []

    def never():
        gate.wait()
        yield from ()

    def stalled(ch: grpc.Channel) -> None:
        try:
            list(ch.stream_stream("/grpc.health.v1.Health/Check")(never(), timeout=NEVER))
        except grpc.RpcError as e:
            codes.append(e.code())

    try:
        with grpc.insecure_channel(srv.address) as ch:
            probe = health_pb2_grpc.HealthStub(ch)
            assert probe.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
            threads = [threading.Thread(target=stalled, args=(ch,)) for _ in range(MAX_OPEN_READS_PER_PEER)]
            for t in threads:
                t.start()
            time.sleep(1.0)  # every stalled call is waiting for its message by now
            with pytest.raises(grpc.RpcError) as err:
                probe.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert f"at most {MAX_OPEN_READS_PER_PEER} at once" in err.value.details()
            for t in threads:
                t.join(timeout=limits.message_timeout_s + 5)
            gate.set()
            assert codes == [grpc.StatusCode.DEADLINE_EXCEEDED] * MAX_OPEN_READS_PER_PEER
            # their slots are free again
            assert probe.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    finally:
        gate.set()
        srv.stop()
