"""The executor port against hostile peers, with real scheduler and executor processes.

Each scenario is one that took the service down, leaked data or stole a slot before: a peer
without a trusted key, a second connection claiming a registered executor's id (with the same
routing id or another, with or without CURVE), a frame bomb, absurd handshakes, a peer that
swallows plans, a revoked key, enrollment proofs that do not fit the key they come with, and
log floods. In every one, a well-formed request running at the same time must complete.
"""

from __future__ import annotations

import contextlib
import threading
import time

import msgpack
import pytest
import zmq

from executor_svc.worker import ExecutorWorker
from pagedserve import wire
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.wire import enrollment
from pagedserve.wire.key_files import load_key_pair, load_public_key
from pagedserve.wire.keys import ClientKeys, make_client, new_key_pair
from testing.stack import Stack
from testing.waits import wait_for

pytestmark = pytest.mark.slow


def _generate(stack: Stack, n: int = 16, timeout: float = 60) -> list[int]:
    req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8, 9], sampling=pb.SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True))
    return [t for resp in stack.stub.Generate(req, timeout=timeout) for c in resp.choices for t in c.token_ids]


def _dealer(stack: Stack, identity: bytes, keys: ClientKeys | None = None) -> zmq.Socket:
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


def _server_public(stack: Stack) -> bytes:
    return load_public_key(stack.keys / "scheduler.key", "scheduler.key")


def _log(stack: Stack) -> str:
    return (stack.logdir / "scheduler.log").read_text(errors="replace")


def _trusted_keys(stack: Stack, name: str) -> ClientKeys:
    """A key pair of its own for a peer named ``name``, listed as trusted, once the scheduler has
    re-read its trusted keys (it polls them every second)."""
    stack.executor_key_args(name)
    keys = ClientKeys(load_key_pair(stack.keys / "executors" / f"{name}.key_secret", name), _server_public(stack))
    wait_for(lambda: f"executor key {keys.own.public.decode()} ({name}) is trusted" in _log(stack), 10,
              f"the scheduler trusting {name}")
    return keys


def _reply(sock: zmq.Socket, frame: bytes, within_s: float = 2.0) -> wire.HandshakeReply | None:
    """The scheduler's answer to ``frame``, or None when none comes."""
    _send_unless_refused(sock, frame)
    return wire.decode(sock.recv()) if sock.poll(int(within_s * 1000)) else None


@pytest.fixture(scope="module")
def secure(tiny_llama_dir, tmp_path_factory):
    """A stack whose executor link runs CurveZMQ, with one real executor whose key is trusted."""
    with Stack.running(tiny_llama_dir, tmp_path_factory.mktemp("secure"), scheduler_args=["--step-timeout", "8"]) as s:
        yield s


def test_a_peer_without_a_trusted_key_never_completes_the_transport_handshake(secure):
    reference = _generate(secure)
    untrusted = ClientKeys(new_key_pair(), _server_public(secure))  # knows the scheduler's key, has its own
    rogues = [_dealer(secure, b"rogue-plain"), _dealer(secure, b"rogue-own-key", untrusted)]
    for sock in rogues:
        _send_unless_refused(sock, _handshake(sock.getsockopt(zmq.ROUTING_ID).decode()))
        _send_unless_refused(sock, msgpack.packb([wire.WIRE_VERSION, wire.KIND_HANDSHAKE, [[[]] * 1000] * 1000]))
    assert _generate(secure) == reference  # served meanwhile, by the real executor only
    for sock in rogues:
        assert _received(sock, 1.0) == []  # not even a refusal: no plan, no prompt, nothing
        sock.close()
    assert [e.id for e in secure.stats().executors] == ["ex0"]


def test_a_second_connection_claiming_a_live_executor_id_is_refused(secure, tiny_llama_dir):
    """With a trusted key of its own, through ex0's routing id (libzmq refuses the connection) or any
    other (the hub refuses the claim): ex0 keeps its slot and serves on."""
    from executor_svc.model import model_fingerprint

    reference = _generate(secure, 24)
    keys = _trusted_keys(secure, "intruder")
    claim = _handshake("ex0", model_fingerprint=model_fingerprint(tiny_llama_dir))
    results = []
    t = threading.Thread(target=lambda: results.append(_generate(secure, 24)))
    t.start()
    same_id = _dealer(secure, b"ex0", keys)
    assert _reply(same_id, claim) is None  # the routing id is connected: not even a refusal
    replies = []
    for i in range(20):  # another routing id each time, as a squatter racing a restart would
        sock = _dealer(secure, f"squatter-{i}".encode(), keys)
        replies.append(_reply(sock, claim))
        sock.close()
    t.join()
    same_id.close()
    assert all(r is not None and not r.accepted for r in replies)
    assert replies[0].reason == "executor id 'ex0' is held by another live connection"
    assert results == [reference]
    assert [(e.id, e.state) for e in secure.stats().executors] == [("ex0", "ready")]
    assert 1 <= _log(secure).count("refused executor 'ex0'") <= 3  # logged, rate-limited


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def test_absurd_handshakes_are_refused_or_cost_nothing(secure, tiny_llama_dir):
    from executor_svc.model import model_fingerprint

    keys = _trusted_keys(secure, "absurd")  # one key may serve several executor ids
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
def _swallowing_executor(stack: Stack, name: str, handshake: wire.Handshake, keys: ClientKeys):
    """A real executor loop (handshake, heartbeats) whose device never finishes a step; stopped on exit
    (a worker left running would outlive the test and log into the next ones)."""
    released = threading.Event()

    class Swallow:
        def reset(self) -> None:
            pass

        def execute(self, plan):
            released.wait(3600)
            return wire.StepResult(plan.step_id, error="released at the end of the test")

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
    with _swallowing_executor(secure, "swallower", hs, _trusted_keys(secure, "swallower")):
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
        assert time.monotonic() - start < 40  # after about --step-timeout, not at their deadline
        st = secure.stats()
        assert st.num_migrations > 0 and [e.id for e in st.executors if e.state != "dead"] == ["ex0"]


def test_revoking_a_key_drops_its_live_executor_and_keeps_it_out(secure, tiny_llama_dir):
    """The key is added to --revoked-executor-keys while its executor holds requests: it is dropped (its
    requests complete on ex0, as after any executor's death), and its reconnections are refused."""
    from executor_svc.model import model_fingerprint

    reference = _generate(secure, 24)
    keys = _trusted_keys(secure, "revokee")
    hs = wire.Handshake("revokee", wire.WIRE_VERSION, model_fingerprint(tiny_llama_dir), "tiny",
                        "LlamaForCausalLM", 512, 16, 4096, 0, 4096, "float32", "cpu")
    with _swallowing_executor(secure, "revokee", hs, keys):
        secure.wait_executors(2)
        outs = [None] * 6

        def run(i):
            outs[i] = _generate(secure, 24, timeout=60)

        threads = [threading.Thread(target=run, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        wait_for(lambda: any(e.id == "revokee" and e.num_running for e in secure.stats().executors), 20,
                  "requests on the executor to revoke")
        with open(secure.revoked, "ab") as f:
            f.write(keys.own.public + b" revokee\n")
        for t in threads:
            t.join()
        assert outs == [reference] * 6
        log = _log(secure)
        assert f"executor revokee declared dead: its key {keys.own.public.decode()} is revoked" in log, log[-3000:]
        assert "did not come back within" not in log.split("(revokee) is revoked")[-1]  # not a step timeout
        # It keeps dialling (its scheduler went silent) and is refused at the transport each time.
        wait_for(lambda: "refused a connection with revoked executor key" in _log(secure), 15, "a refused redial")
        assert [e.id for e in secure.stats().executors if e.state != "dead"] == ["ex0"]


@pytest.fixture(scope="module")
def loopback(tiny_llama_dir, tmp_path_factory):
    """A stack without keys: its executor port is on loopback only, and unauthenticated."""
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


def test_without_curve_a_live_id_is_bound_to_its_connection(loopback):
    reference = _generate(loopback, 16)
    squatter = _dealer(loopback, b"squatter")
    reply = _reply(squatter, _handshake("ex0"))
    squatter.close()
    assert reply is not None and not reply.accepted and "held by another live connection" in reply.reason
    assert _generate(loopback, 16) == reference
    assert [(e.id, e.state) for e in loopback.stats().executors] == [("ex0", "ready")]


@pytest.fixture(scope="module")
def enrolling(tiny_llama_dir, tmp_path_factory):
    """A scheduler that trusts no key but enrolls executors with a token (no executor of its own: the
    peers here are sockets)."""
    s = Stack(tiny_llama_dir, tmp_path_factory.mktemp("enrolling"), enrollment=True)
    try:
        s.start_scheduler()
        yield s
    finally:
        s.stop()


def test_a_key_enrolls_with_a_proof_made_for_it_and_the_token_claims_no_live_id(enrolling, tiny_llama_dir):
    from executor_svc.model import model_fingerprint

    server, fingerprint = _server_public(enrolling), model_fingerprint(tiny_llama_dir)
    token = enrollment.read_tokens(enrolling.token_file)[0]
    mine, thief = ClientKeys(new_key_pair(), server), ClientKeys(new_key_pair(), server)

    def claim(keys: ClientKeys, routing: bytes, proof: bytes, executor_id: str = "pod-a") -> wire.HandshakeReply | None:
        sock = _dealer(enrolling, routing, keys)
        reply = _reply(sock, _handshake(executor_id, model_fingerprint=fingerprint, enrollment_proof=proof))
        sock.close()
        return reply

    good = enrollment.proof(token, server, mine.own.public, "pod-a")
    assert "carries no enrollment proof" in claim(mine, b"a1", b"").reason
    assert "matches no enrollment token" in claim(thief, b"t1", good).reason  # replayed with another key
    assert "matches no enrollment token" in claim(mine, b"a2", enrollment.proof(b"x" * 32, server, mine.own.public,
                                                                                 "pod-a")).reason
    live = _dealer(enrolling, b"pod-a", mine)
    assert _reply(live, _handshake("pod-a", model_fingerprint=fingerprint, enrollment_proof=good)).accepted
    # The token lets the thief enroll a key of its own, never take a live executor's id.
    stolen = enrollment.proof(token, server, thief.own.public, "pod-a")
    assert claim(thief, b"t2", stolen).reason == "executor id 'pod-a' is held by another live connection"
    assert f"key {mine.own.public.decode()} (enrolled)" in _log(enrolling)
    live.close()
    # A revoked key gets no connection, proof or not.
    with open(enrolling.revoked, "ab") as f:
        f.write(thief.own.public + b" thief\n")
    wait_for(lambda: "(thief) is revoked" in _log(enrolling), 10, "the revocation read")
    assert claim(thief, b"t3", enrollment.proof(token, server, thief.own.public, "pod-b"), "pod-b") is None


def test_a_rotated_token_enrolls_and_the_old_one_no_longer_does(enrolling, tiny_llama_dir):
    from executor_svc.model import model_fingerprint

    server, fingerprint = _server_public(enrolling), model_fingerprint(tiny_llama_dir)
    old, new = enrollment.read_tokens(enrolling.token_file)[0], enrollment.new_token().encode()
    enrolling.token_file.write_bytes(new + b"\n")
    wait_for(lambda: "enrollment tokens changed" in _log(enrolling), 10, "the token file read again")
    for token, accepted in ((old, False), (new, True)):
        keys = ClientKeys(new_key_pair(), server)
        sock = _dealer(enrolling, b"rotated-" + token[:4], keys)
        proof = enrollment.proof(token, server, keys.own.public, "pod-r")
        reply = _reply(sock, _handshake("pod-r", model_fingerprint=fingerprint, enrollment_proof=proof))
        sock.close()
        assert reply.accepted is accepted, reply.reason
