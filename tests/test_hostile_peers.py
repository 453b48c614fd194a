"""The executor port against hostile peers, with real scheduler and executor processes.

Each scenario is one that took the service down or leaked data before (issue "Trust
boundaries"): a peer without the cluster secret, a socket reusing a registered executor's
id, a frame bomb, absurd handshakes, a peer that swallows plans, and log floods. In every
one, a well-formed request running at the same time must complete.
"""

from __future__ import annotations

import contextlib
import threading
import time

import msgpack
import pytest
import zmq
from stack import Stack, write_secret

from executor_svc.worker import ExecutorWorker
from pagedserve import wire
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.wire.keys import derive_keys, make_client, read_cluster_secret

pytestmark = pytest.mark.slow


def _generate(stack: Stack, n: int = 16, timeout: float = 60) -> list[int]:
    req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8, 9], sampling=pb.SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True))
    return [t for resp in stack.stub.Generate(req, timeout=timeout) for c in resp.choices for t in c.token_ids]


def _dealer(stack: Stack, identity: bytes, keys=None) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTING_ID, identity)
    if keys is not None:
        make_client(sock, keys)
    sock.connect(f"tcp://127.0.0.1:{stack.executor_port}")
    return sock


def _handshake(executor_id: str, **overrides) -> bytes:
    fields = dict(executor_id=executor_id, wire_version=wire.WIRE_VERSION, model_fingerprint="x" * 64,
                  model_name="tiny", architecture="LlamaForCausalLM", vocab_size=512, block_size=16,
                  num_device_blocks=64, num_cpu_blocks=0, max_model_len=4096, dtype="float32", device="cpu")
    fields.update(overrides)
    return wire.encode(wire.Handshake(**fields))


def _send_unless_refused(sock: zmq.Socket, frame: bytes) -> None:
    """Send, or stop trying once the transport has refused the peer: libzmq then drops
    the connection's pipe, and a blocking send on a DEALER with no pipe waits forever."""
    try:
        sock.send(frame, zmq.NOBLOCK)
    except zmq.Again:
        pass


def _received(sock: zmq.Socket, within_s: float) -> list[bytes]:
    frames = []
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        if sock.poll(int(left * 1000)):
            frames.append(sock.recv())
    return frames


@pytest.fixture(scope="module")
def secure(tiny_llama_dir, tmp_path_factory):
    """A stack whose executor link runs CurveZMQ, with one real executor."""
    with Stack.running(tiny_llama_dir, tmp_path_factory.mktemp("secure"), scheduler_args=["--step-timeout", "3"]) as s:
        yield s


def test_a_peer_without_the_secret_never_completes_the_transport_handshake(secure, tmp_path):
    reference = _generate(secure)
    other = derive_keys(read_cluster_secret(write_secret(tmp_path / "not-the-secret")))
    rogues = [_dealer(secure, b"rogue-plain"), _dealer(secure, b"rogue-wrong-key", other)]
    for sock in rogues:
        _send_unless_refused(sock, _handshake(sock.getsockopt(zmq.ROUTING_ID).decode()))
        _send_unless_refused(sock, msgpack.packb([wire.WIRE_VERSION, wire.KIND_HANDSHAKE, [[[]] * 1000] * 1000]))
    assert _generate(secure) == reference  # served meanwhile, by the real executor only
    for sock in rogues:
        assert _received(sock, 1.0) == []  # not even a refusal: no plan, no prompt, nothing
        sock.close()
    assert [e.id for e in secure.stats().executors] == ["ex0"]


def test_a_registered_executor_id_cannot_be_taken_over(secure):
    keys = derive_keys(read_cluster_secret(secure.secret_file))
    hijack = _dealer(secure, b"ex0", keys)  # even with the secret: the id is connected
    hijack.send(_handshake("ex0"))
    results = []
    t = threading.Thread(target=lambda: results.append(_generate(secure, 24)))
    t.start()
    got = _received(hijack, 2.0)
    t.join()
    hijack.close()
    assert got == [] and len(results[0]) == 24
    assert [(e.id, e.state) for e in secure.stats().executors] == [("ex0", "ready")]


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_absurd_handshakes_are_refused_or_cost_nothing(secure, tiny_llama_dir):
    from executor_svc.model import model_fingerprint

    keys = derive_keys(read_cluster_secret(secure.secret_file))
    real = model_fingerprint(tiny_llama_dir)  # computable from the public model files
    info = secure.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    rss = _rss_mib(secure.scheduler.pid)
    replies = {}
    for name, fields in {"fake-model": {},
                         "fake-vocab": {"model_fingerprint": real, "vocab_size": 7},
                         "fake-blocks": {"model_fingerprint": real, "num_device_blocks": 2**31 - 1,
                                         "num_cpu_blocks": 2**31 - 1},
                         "fake-len": {"model_fingerprint": real, "max_model_len": 2}}.items():
        sock = _dealer(secure, name.encode(), keys)
        sock.send(_handshake(name, **fields))
        got = _received(sock, 1.0)
        replies[name] = wire.decode(got[0]) if got else None
        sock.close()  # accepted ones go silent: declared dead after a few heartbeats
    assert not replies["fake-model"].accepted and "model fingerprint" in replies["fake-model"].reason
    assert not replies["fake-vocab"].accepted and "vocab size 7" in replies["fake-vocab"].reason
    assert replies["fake-blocks"].accepted and replies["fake-len"].accepted
    # 2**31 blocks cost no memory until used, and a 2-token executor narrows only its own admissions.
    assert _rss_mib(secure.scheduler.pid) - rss < 50
    assert secure.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5).max_model_len == info.max_model_len
    assert len(_generate(secure)) == 16
    deadline = time.monotonic() + 10
    while len(secure.stats().executors) > 1:
        assert time.monotonic() < deadline
        time.sleep(0.2)


@contextlib.contextmanager
def _swallowing_executor(stack: Stack, name: str, handshake: wire.Handshake):
    """A real executor loop (handshake, heartbeats) whose device never finishes a step; stopped on exit
    (a worker left running would outlive the test and log into the next ones)."""
    released = threading.Event()

    class Swallow:
        def reset(self) -> None:
            pass

        def execute(self, plan):
            released.wait(3600)
            return wire.StepResult(plan.step_id, error="released at the end of the test")

    keys = derive_keys(read_cluster_secret(stack.secret_file))
    worker = ExecutorWorker(f"tcp://127.0.0.1:{stack.executor_port}", Swallow(), handshake, keys=keys)
    t = threading.Thread(target=worker.run, daemon=True, name=name)
    t.start()
    try:
        yield
    finally:
        released.set()
        worker.request_drain()
        worker.request_drain()  # the second signal: exit at once
        t.join(10)
        assert not t.is_alive()


def test_a_peer_that_swallows_plans_while_heartbeating_loses_its_requests_to_others(secure, tiny_llama_dir):
    from executor_svc.model import model_fingerprint

    reference = _generate(secure, 24)
    hs = wire.Handshake("swallower", wire.WIRE_VERSION, model_fingerprint(tiny_llama_dir), "tiny",
                        "LlamaForCausalLM", 512, 16, 4096, 0, 4096, "float32", "cpu")
    with _swallowing_executor(secure, "swallower", hs):
        secure.wait_executors(2)
        # Both look ready; the router sends work to both. The swallower's steps never come back.
        outs = [None] * 8

        def run(i):
            outs[i] = _generate(secure, 24, timeout=60)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(8)]
        start = time.monotonic()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert outs == [reference] * 8  # every request finished, identical, on the real executor
        assert time.monotonic() - start < 30  # after about --step-timeout, not at their deadline
        st = secure.stats()
        assert st.num_migrations > 0 and [e.id for e in st.executors if e.state != "dead"] == ["ex0"]


@pytest.fixture(scope="module")
def loopback(tiny_llama_dir, tmp_path_factory):
    """A stack without a cluster secret: its executor port is on loopback only, and unauthenticated."""
    with Stack.running(tiny_llama_dir, tmp_path_factory.mktemp("loopback"), secure=False) as s:
        yield s


def test_frame_bombs_and_floods_neither_stall_the_loop_nor_flood_the_log(loopback):
    reference = _generate(loopback, 32)
    bombs = [
        msgpack.packb([wire.WIRE_VERSION, wire.KIND_HANDSHAKE, [[[]] * 600] * 3]),  # under 4 KiB: decoded, refused
        msgpack.packb([wire.WIRE_VERSION, wire.KIND_HANDSHAKE, [[]] * (15 * 2**20)]),  # 15 MiB: refused unread
        b"\x93" * (8 * 2**20),  # 8 MiB of nested array headers
    ]
    done = []
    t = threading.Thread(target=lambda: done.append((_generate(loopback, 32), time.monotonic())))
    start = time.monotonic()
    t.start()
    sock = _dealer(loopback, b"bomber")
    for i in range(20_000):
        sock.send(bombs[i % 3] if i < 30 else b"\xc1garbage")
    t.join()
    sock.close()
    tokens, finished = done[0]
    assert tokens == reference and finished - start < 20
    log = (loopback.logdir / "scheduler.log").read_text()
    assert 1 <= log.count("dropping a malformed frame") <= 5, log[-3000:]  # rate-limited, not 20,000 lines
    assert "more like it" in log or log.count("dropping a malformed frame") == 1
