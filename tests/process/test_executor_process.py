"""The executor as a separate process over real ZeroMQ; the test plays the scheduler's ROUTER."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch
import zmq
from grpc_health.v1 import health_pb2, health_pb2_grpc

from executor_svc.kv_cache import bytes_per_block
from executor_svc.model import load_model_config, model_fingerprint
from pagedserve import wire
from testing.stack import free_port

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]  # (tests/process/)
HB = 0.25  # heartbeat interval the fake scheduler hands out


class FakeScheduler:
    """The ROUTER side. A background thread heartbeats (while ``beating``) and queues what arrives,
    so a slow test step (health polls on a loaded machine) never looks like a silent scheduler."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.peer: bytes | None = None
        self.heartbeats = 0
        self.beating = True
        self.inbox: queue.Queue = queue.Queue()
        self._lock = threading.Lock()  # every socket operation, from either thread
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            with self._lock:
                if self.beating and self.peer is not None and time.monotonic() >= next_beat:
                    self.sock.send_multipart([self.peer, wire.encode(wire.Heartbeat(time.time()))])
                    next_beat = time.monotonic() + HB
                frames = self.sock.recv_multipart() if self.sock.poll(0) else None
            if frames is None:
                time.sleep(0.02)
                continue
            self.peer = frames[0]
            msg = wire.decode(frames[1])
            if isinstance(msg, wire.Heartbeat):
                self.heartbeats += 1
            else:
                self.inbox.put(msg)

    def send(self, msg) -> None:
        self.send_raw(wire.encode(msg))

    def send_raw(self, payload: bytes) -> None:
        with self._lock:
            self.sock.send_multipart([self.peer, payload])

    def recv(self, kind: type, timeout: float = 60.0):
        """The next non-heartbeat message, which must be a ``kind``."""
        try:
            msg = self.inbox.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no {kind.__name__} within {timeout}s") from None
        assert isinstance(msg, kind), f"expected {kind.__name__}, got {msg!r}"
        return msg

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        self.ctx.term()


def _health(port: int, service: str) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        req = health_pb2.HealthCheckRequest(service=service)
        return health_pb2_grpc.HealthStub(ch).Check(req, timeout=5).status


def _wait_health(port: int, service: str, status: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _health(port, service) != status:
        assert time.monotonic() < deadline, f"{service} never became {status}"
        time.sleep(0.05)


def _spawn(model_dir: Path, sched_port: int, health_port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PAGEDSERVE_KV_CACHE_MEMORY": "2MiB"}
    cmd = [sys.executable, "-m", "executor_svc", "--model", str(model_dir),
           "--scheduler", f"tcp://127.0.0.1:{sched_port}", "--swap-space", "256KiB",
           "--health-port", str(health_port), "--drain-timeout", "20", "--executor-id", "exec-test"]
    return subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def _plan(step: int, new=(), sched=(), n=()) -> wire.BatchPlan:
    return wire.BatchPlan(step, list(sched), list(n), new_seqs=list(new))


@pytest.fixture
def sched():
    s = FakeScheduler()
    yield s
    s.close()


def test_executor_process_lifecycle(tiny_llama_dir, sched):
    health_port = free_port()
    proc = _spawn(tiny_llama_dir, sched.port, health_port)
    try:
        hs = sched.recv(wire.Handshake)
        cfg = load_model_config(tiny_llama_dir)
        assert (hs.executor_id, hs.wire_version, hs.block_size, hs.device) == ("exec-test", wire.WIRE_VERSION, 16, "cpu")
        assert hs.model_fingerprint == model_fingerprint(tiny_llama_dir)
        assert hs.num_device_blocks == (2 << 20) // bytes_per_block(cfg, 16, torch.float32)
        assert hs.vocab_size == cfg.vocab_size and hs.architecture == "LlamaForCausalLM"
        assert _health(health_port, "liveness") == health_pb2.HealthCheckResponse.SERVING
        assert _health(health_port, "executor") == health_pb2.HealthCheckResponse.NOT_SERVING
        sched.send(wire.HandshakeReply(True, "", HB))
        _wait_health(health_port, "executor", health_pb2.HealthCheckResponse.SERVING)

        sched.send_raw(b"\x93\x01\x04garbage")  # malformed: logged and dropped
        sched.send_raw(b"\xc1")
        sched.send_raw(bytes([0x94, wire.WIRE_VERSION, 4, 1]) + b"\x91" * 5000 + b"\xc0")  # nested 5,000 deep: dropped too
        greedy = wire.SamplingParams(temperature=0.0)
        prompt = list(range(20, 40))
        sched.send(_plan(1, [wire.NewSeq(7, wire.pack_ids(prompt), len(prompt), [0, 1], 0, greedy)], [7], [20]))
        res = sched.recv(wire.StepResult)
        assert res.step_id == 1 and res.error is None and res.sampled_seq_ids == [7]
        first_token = res.sampled_token_ids
        sched.send(_plan(2, sched=[7], n=[1]))
        assert sched.recv(wire.StepResult).sampled_seq_ids == [7]
        assert sched.heartbeats >= 1

        # Scheduler silent for > 5 intervals: the executor re-handshakes and forgets seq 7.
        sched.beating = False
        hs2 = sched.recv(wire.Handshake, timeout=5 * HB + 10)
        assert hs2.executor_id == "exec-test"
        sched.beating = True
        sched.send(wire.HandshakeReply(True, "", HB))
        sched.send(_plan(3, sched=[7], n=[1]))
        res = sched.recv(wire.StepResult)
        assert res.step_id == 3 and res.refused and res.failed_seq_ids == [7] and "unknown seq 7" in res.error
        sched.send(_plan(4, [wire.NewSeq(8, wire.pack_ids(prompt), len(prompt), [0, 1], 0, greedy)], [8], [20]))
        res = sched.recv(wire.StepResult)  # behind a refused plan: refused too, nothing applied
        assert res.step_id == 4 and res.refused and res.error.startswith("discarded")
        sched.send(wire.Reset("plan 3 was refused"))

        # SIGTERM: Drain, health goes NOT_SERVING, plans still run until the scheduler stops.
        proc.send_signal(signal.SIGTERM)
        drain = sched.recv(wire.Drain, timeout=10)
        assert drain.grace_seconds == 20.0
        _wait_health(health_port, "executor", health_pb2.HealthCheckResponse.NOT_SERVING)
        sched.send(_plan(5, [wire.NewSeq(8, wire.pack_ids(prompt), len(prompt), [0, 1], 0, greedy)], [8], [20]))
        res = sched.recv(wire.StepResult)  # after the reset: same prompt, greedy, fresh state: same first token
        assert res.step_id == 5 and res.sampled_seq_ids == [8] and res.sampled_token_ids == first_token
        assert proc.wait(timeout=15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0].decode(errors="replace")
    # Three garbage frames, one log line: what peers send wrong is rate-limited.
    assert out.count("dropping a malformed frame") == 1, out


def test_refused_handshake_exits_with_the_reason(tiny_llama_dir, sched):
    proc = _spawn(tiny_llama_dir, sched.port, 0)
    try:
        sched.recv(wire.Handshake)
        sched.send(wire.HandshakeReply(False, "block size 16, scheduler uses 32", HB))
        assert proc.wait(timeout=15) == 2
    finally:
        if proc.poll() is None:
            proc.kill()
        out = proc.communicate()[0].decode(errors="replace")
    assert "block size 16, scheduler uses 32" in out


def test_an_executor_whose_id_is_in_use_says_so(tiny_llama_dir, sched):
    """The scheduler keeps the first connection of an id and libzmq holds a second one's messages
    unread: the second executor reconnected forever saying only "lost the scheduler"."""
    holder = sched.ctx.socket(zmq.DEALER)
    holder.setsockopt(zmq.ROUTING_ID, b"exec-test")  # another executor, alive, with the same id
    holder.setsockopt(zmq.LINGER, 0)
    holder.connect(f"tcp://127.0.0.1:{sched.port}")
    holder.send(wire.encode(wire.Heartbeat(time.time())))
    proc = _spawn(tiny_llama_dir, sched.port, 0)
    lines: list[str] = []
    try:
        reader = threading.Thread(target=lambda: lines.extend(
            line.decode(errors="replace") for line in proc.stdout), daemon=True)
        reader.start()
        deadline = time.monotonic() + 90  # (model load, then 3 dials of 5 s silence each)
        while not any("--executor-id exec-test is probably in use" in line for line in lines):
            assert time.monotonic() < deadline and proc.poll() is None, "".join(lines)
            time.sleep(0.2)
        assert sum("lost the scheduler" in line for line in lines) >= 3
        assert sched.inbox.empty()  # (nothing of it ever reached the scheduler)
    finally:
        proc.kill()
        proc.wait()
        holder.close()
