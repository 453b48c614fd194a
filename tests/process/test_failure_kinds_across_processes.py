"""Failure semantics across real processes: hostile frames on the executor port, and a migration
to an executor with a shorter context after kill -9.

The scheduler and executors run as deployed (testing/stack.py), with the executor link on loopback
without keys, where any local process can reach the port: the frames below are what such a
process (or, with keys, a compromised executor) can send.
"""

from __future__ import annotations

import random
import threading
import time

import grpc
import pytest
import zmq
from grpc_health.v1 import health_pb2

from pagedserve import wire
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.wire.fingerprint import model_fingerprint
from testing.stack import Stack
from tests.unit.wire.test_wire_contract import NESTED, VALID_FRAMES

pytestmark = pytest.mark.slow
SERVING = health_pb2.HealthCheckResponse.SERVING


def _generate(stack: Stack, prompt: list[int], n: int = 16, timeout: float = 120) -> list[int]:
    req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True))
    return [t for resp in stack.stub.Generate(req, timeout=timeout) for c in resp.choices for t in c.token_ids]


def _dealer(stack: Stack, identity: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    sock.setsockopt(zmq.SNDHWM, 100_000)
    sock.connect(f"tcp://127.0.0.1:{stack.executor_port}")
    return sock


def _register(sock: zmq.Socket, name: str, fingerprint: str) -> None:
    hs = wire.Handshake(name, wire.WIRE_VERSION, fingerprint, "tiny", "LlamaForCausalLM", 512, 16, 64, 0,
                        4096, "float32", "cpu")
    sock.send(wire.encode(hs))
    assert sock.poll(10_000), "no handshake reply"
    reply = wire.decode(sock.recv())
    assert isinstance(reply, wire.HandshakeReply) and reply.accepted, reply


def _mutants(rnd: random.Random, count: int) -> list[bytes]:
    """Frames of every shape the codec fuzzer tries (tests/unit/wire/test_wire_contract.py): flipped, truncated, grown,
    nested thousands deep, claiming 4 GB."""
    out = [b"\x93\x02\x01" + b"\x91" * 1000]  # the review's 1,003-byte frame, first
    for _ in range(count):
        frame = rnd.choice(VALID_FRAMES)
        at = rnd.randrange(len(frame) + 1)
        op = rnd.randrange(5)
        if op == 0:
            frame = frame[:at] + bytes([rnd.randrange(256)]) + frame[at + 1:]
        elif op == 1:
            frame = frame[:at]
        elif op == 2:
            frame = frame[:at] + rnd.randbytes(rnd.randrange(1, 16)) + frame[at:]
        elif op == 3:
            frame = frame[:at] + rnd.choice(NESTED) + frame[at:]
        else:
            frame = frame[:at] + bytes([rnd.choice([0xdc, 0xdd, 0xde, 0xdf, 0xdb, 0xc6])]) + b"\xff" * 4 + frame[at:]
        out.append(frame)
    return out


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tmp_path_factory):
    with Stack.running(tiny_llama_dir, tmp_path_factory.mktemp("fuzz"), secure=False,
                       scheduler_args=["--step-timeout", "5"]) as s:
        yield s


def test_no_frame_on_the_executor_port_stops_the_scheduler(stack, tiny_llama_dir):
    prompt = list(range(40, 60))
    reference = _generate(stack, prompt)
    rnd = random.Random(27)
    outsider = _dealer(stack, b"outsider")
    for frame in _mutants(rnd, 3000) + [b"\x93\x02\x01" + b"\x91" * 1000] * 2000:
        outsider.send(frame)
    # A registered peer's malformed frame drops that peer (its frames are trusted no more); it may
    # register again, and the genuine executor serves throughout.
    fingerprint = model_fingerprint(tiny_llama_dir)
    during: list = []
    t = threading.Thread(target=lambda: during.append(_generate(stack, prompt, timeout=60)))
    t.start()
    for i, frame in enumerate(_mutants(rnd, 60)):
        peer = _dealer(stack, f"fuzzer-{i}".encode())
        _register(peer, f"fuzzer-{i}", fingerprint)
        peer.send(frame)
        peer.close()
    t.join()
    outsider.close()
    time.sleep(1.5)  # a second health poll after the last frame
    assert during == [reference]
    assert _generate(stack, prompt) == reference
    assert stack.health("liveness") == SERVING and stack.health() == SERVING
    assert [e.id for e in stack.stats().executors if e.state == "ready"] == ["ex0"]
    assert stack.scheduler.poll() is None


def test_results_for_steps_never_sent_drop_their_sender_without_being_decoded(stack, tiny_llama_dir):
    """40 well-formed results of ~15 MB for steps never sent: the first one drops the peer, none is
    parsed, and the loop never freezes (a request running meanwhile keeps its pace)."""
    prompt = list(range(80, 100))
    reference = _generate(stack, prompt, n=32)
    peer = _dealer(stack, b"flooder")
    _register(peer, "flooder", model_fingerprint(tiny_llama_dir))
    n = 1_500_000
    big = wire.encode(wire.StepResult(10_000, list(range(1 << 20, (1 << 20) + n)), [1 << 20] * n))
    assert len(big) > 14_000_000
    started = time.monotonic()
    done: list = []
    t = threading.Thread(target=lambda: done.append((_generate(stack, prompt, n=32), time.monotonic())))
    t.start()
    for _ in range(40):
        peer.send(big)
    t.join()
    peer.close()
    tokens, finished = done[0]
    assert tokens == reference
    assert finished - started < 20
    log = (stack.logdir / "scheduler.log").read_text()
    assert "executor flooder declared dead: protocol error: a result for step 10000" in log
    assert [e.id for e in stack.stats().executors if e.state == "ready"] == ["ex0"]


def test_a_request_no_survivor_can_hold_fails_at_once_after_kill_9(tiny_llama_dir, tmp_path):
    """Executors of 4,096 and 320 tokens of context; the long one is killed while a request that
    may reach 630 tokens runs on it: that request fails at once (UNAVAILABLE), the short ones move
    to the survivor and finish exactly as they would have."""
    short_prompts = [[(i * 11 + j * 5) % 480 + 3 for j in range(20)] for i in range(4)]
    s = Stack(tiny_llama_dir, tmp_path, secure=False)
    try:
        s.start_scheduler()
        s.start_executor("short", "--kv-cache-memory", "160KiB")  # 20 blocks of 16: 320 tokens
        s.wait_executors(1)
        reference = [_generate(s, p, n=40) for p in short_prompts]
        s.start_executor("long")
        s.wait_executors(2)
        results: dict[str, object] = {}
        progress = {"long": 0}

        def run(name: str, prompt: list[int], n: int) -> None:
            req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
                max_tokens=n, temperature=0.0, ignore_eos=True))
            toks: list[int] = []
            try:
                for resp in s.stub.Generate(req, timeout=120):
                    for c in resp.choices:
                        toks.extend(c.token_ids)
                    progress[name] = len(toks)
                results[name] = toks
            except grpc.RpcError as exc:
                results[name] = (exc, time.monotonic())

        threads = [threading.Thread(target=run, args=("long", list(range(3, 33)), 600))]
        threads += [threading.Thread(target=run, args=(f"short{i}", p, 40)) for i, p in enumerate(short_prompts)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while progress["long"] < 100 and time.monotonic() < deadline:
            time.sleep(0.01)
        killed_at = time.monotonic()
        s.executors["long"].kill()  # kill -9
        for t in threads:
            t.join()
        exc, ended_at = results["long"]
        assert exc.code() == grpc.StatusCode.UNAVAILABLE and "max_model_len is 320" in exc.details()
        assert ended_at - killed_at < 10  # at once: the death is noticed after 5 heartbeats of 0.5 s
        assert [results[f"short{i}"] for i in range(4)] == reference
    finally:
        s.stop()
