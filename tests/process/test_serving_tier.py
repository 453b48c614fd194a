"""The serving tier across real processes: fronts of the scheduler's own, a front of its own, and
what a front's death or a hostile peer on the front link does.

The scheduler process is the engine core and starts ``--api-server-count`` fronts that share its
public ports (testing/stack.py starts it as deployed). Outputs must not depend on how many fronts
serve, a front killed with kill -9 must cost only its own streams (their blocks freed at once),
and nothing on the front link may reach the core without being a front it admits.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from datetime import datetime

import grpc
import pytest
import zmq

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.wire import DEAD_AFTER_INTERVALS
from pagedserve.wire import front_messages as m
from pagedserve.wire.key_files import write_key_pair
from testing.stack import Stack, free_port, stream_tokens

pytestmark = pytest.mark.slow


def _prompts(n: int) -> list[list[int]]:
    return [[(i * 17 + j * 5) % 480 + 3 for j in range(10 + i % 9)] for i in range(n)]


def _run(stack: Stack, prompts, tokens: int = 24, channels: int = 8, progress=None):
    """Each prompt on a channel of its own (new connections: the kernel spreads them over the fronts)."""
    out: list = [None] * len(prompts)
    # A subchannel pool of its own per channel: gRPC would otherwise share one connection among them.
    chans = [grpc.insecure_channel(f"127.0.0.1:{stack.port}", options=[("grpc.use_local_subchannel_pool", 1)])
             for _ in range(channels)]

    def one(i: int) -> None:
        req = pb.GenerateRequest(prompt_token_ids=prompts[i], sampling=pb.SamplingParams(
            max_tokens=tokens, temperature=0.0, ignore_eos=True))
        out[i] = stream_tokens(pb_stub(chans[i % channels]), req, 120, progress, i)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return threads, out, chans


def pb_stub(channel):
    from pagedserve.v1 import generation_pb2_grpc as pb_grpc

    return pb_grpc.GenerationStub(channel)


def _fronts(stack: Stack) -> list[int]:
    """The pids of the scheduler's fronts (its children)."""
    out = subprocess.run(["pgrep", "-P", str(stack.scheduler.pid)], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _front_id(stack: Stack, pid: int) -> str:
    """The front id the scheduler gave the front it started as ``pid`` (its log says so)."""
    found = re.findall(rf"started (local-\d+\.\d+) \(pid {pid}\)", (stack.logdir / "scheduler.log").read_text())
    assert len(found) == 1, f"pid {pid} is not one of the scheduler's fronts\n{stack.logs()}"
    return found[0]


def _dropped(stack: Stack, front_id: str, timeout_s: float = 30.0) -> tuple[float, str, int]:
    """When the core dropped ``front_id`` (the wall-clock time of its log line), why, and how many
    of its requests it aborted then."""
    pattern = re.compile(rf"^(\S+ \S+) WARNING \S+: front {re.escape(front_id)} dropped \((.*)\); "
                         rf"(\d+) of its requests aborted$", re.MULTILINE)
    deadline = time.monotonic() + timeout_s
    while (found := pattern.search((stack.logdir / "scheduler.log").read_text(errors="replace"))) is None:
        assert time.monotonic() < deadline, f"the core did not drop front {front_id}\n{stack.logs()}"
        time.sleep(0.05)
    when = datetime.strptime(found[1], "%Y-%m-%d %H:%M:%S,%f").timestamp()  # logging's asctime, local time
    return when, found[2], int(found[3])


def test_outputs_do_not_depend_on_the_number_of_fronts(tiny_llama_dir, tmp_path):
    prompts = _prompts(24)
    results = {}
    for count in (1, 3):
        (tmp_path / f"fronts-{count}").mkdir()
        with Stack.running(tiny_llama_dir, tmp_path / f"fronts-{count}", secure=False,
                           scheduler_args=["--api-server-count", str(count)]) as s:
            assert len(_fronts(s)) == count
            threads, out, chans = _run(s, prompts)
            for t in threads:
                t.join()
            for c in chans:
                c.close()
            results[count] = out
    assert all(isinstance(o, list) and len(o) == 24 for o in results[1])
    assert results[3] == results[1]


def test_a_front_killed_loses_only_its_own_streams_and_their_blocks_are_freed_at_once(tiny_llama_dir, tmp_path):
    with Stack.running(tiny_llama_dir, tmp_path, secure=False, scheduler_args=["--api-server-count", "2"]) as s:
        prompts = _prompts(16)
        reference_threads, reference, chans = _run(s, prompts, tokens=200)
        for t in reference_threads:
            t.join()
        for c in chans:
            c.close()
        progress = [0] * len(prompts)
        threads, out, chans = _run(s, prompts, tokens=200, channels=16, progress=progress)
        while sum(1 for p in progress if p >= 5) < len(prompts):
            time.sleep(0.01)
        victim = _fronts(s)[0]
        victim_id = _front_id(s, victim)
        killed_at = time.time()  # wall clock, as the scheduler's log lines are stamped
        subprocess.run(["kill", "-9", str(victim)], check=True)
        for t in threads:
            t.join()
        lost = [i for i, o in enumerate(out) if isinstance(o, grpc.RpcError)]
        assert 0 < len(lost) < len(prompts), "both fronts served some of the streams"
        for i, o in enumerate(out):
            if i not in lost:
                assert o == reference[i]  # the other front's streams did not notice
        # The core aborted every request of that front at once (their blocks are freed by the next
        # step), not once the front link found it silent for the dead-peer interval: the scheduler
        # polls its children every 0.1 s, and a send to the dead front fails (its next update or
        # status). test_tier_link_failures.py checks the first of them alone.
        dropped_at, why, aborted = _dropped(s, victim_id)
        dead_peer_s = DEAD_AFTER_INTERVALS * m.HEARTBEAT_INTERVAL_S
        assert why == "exited with status -9" or why.startswith("send failed"), s.logs()
        assert aborted == len(lost), s.logs()
        assert dropped_at - killed_at < dead_peer_s / 2, f"dropped {dropped_at - killed_at:.2f}s after the kill"
        # Nothing is left once the other front's streams have ended: the lost ones' blocks were freed too.
        s.wait_blocks_free(timeout_s=10)
        # The front is started again; both keep the ports.
        deadline = time.monotonic() + 60
        while len(_fronts(s)) < 2 or victim in _fronts(s):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        for c in chans:
            c.close()
        threads, again, chans = _run(s, prompts[:8], tokens=200)
        for t in threads:
            t.join()
        assert again == reference[:8]
        for c in chans:
            c.close()


def test_a_front_of_its_own_serves_over_the_curve_front_link(tiny_llama_dir, tmp_path):
    """pagedserve-front against the scheduler's --front-link-port: its key admitted, it serves the same
    tokens; a peer without an admitted key gets nothing through."""
    link_port, front_port = free_port(), free_port()
    s = Stack(tiny_llama_dir, tmp_path)  # (secure: the scheduler has its own key pair)
    front_keys = tmp_path / "front-keys"
    pair = write_key_pair(front_keys, "front-a")
    trusted = tmp_path / "trusted-fronts"
    trusted.mkdir()
    (trusted / "front-a.key").write_bytes((front_keys / "front-a.key").read_bytes())
    s.scheduler_args = ["--front-link-port", str(link_port), "--trusted-front-keys", str(trusted)]
    front = None
    try:
        s.start_scheduler()
        s.start_executor("ex0")
        s.wait_health()
        reference = _collect(s.stub, list(range(30, 50)))
        front = s._spawn("front", [
            "-m", "scheduler_svc.entrypoints.front", "--model", str(tiny_llama_dir), "--core",
            f"tcp://127.0.0.1:{link_port}", "--curve-key-file", str(front_keys / "front-a.key_secret"),
            "--scheduler-public-key-file", str(s.keys / "scheduler.key"), "--host", "127.0.0.1",
            "--port", str(front_port), "--http-port", "0", "--front-id", "remote-a"])
        channel = s.open_channel()
        channel.close()
        own = Stack.__new__(Stack)
        own.channel = grpc.insecure_channel(f"127.0.0.1:{front_port}")
        deadline = time.monotonic() + 60
        while True:
            try:
                got = _collect(own.stub, list(range(30, 50)))
                break
            except grpc.RpcError:
                assert time.monotonic() < deadline and front.poll() is None, s.logs()
                time.sleep(0.2)
        assert got == reference and pair.public
        own.channel.close()
        # A peer without an admitted key: its handshake never completes, nothing reaches the core.
        rogue = zmq.Context.instance().socket(zmq.DEALER)
        rogue.setsockopt(zmq.LINGER, 0)
        rogue.connect(f"tcp://127.0.0.1:{link_port}")
        rogue.send(m.TIER.encode(m.FrontHello("rogue", m.TIER_VERSION)), zmq.NOBLOCK)
        assert not rogue.poll(1000)
        rogue.close()
        assert "front rogue joined" not in (tmp_path / "scheduler.log").read_text()
    finally:
        if front is not None and front.poll() is None:
            front.terminate()
            front.wait(15)
        s.stop()


def _collect(stub, prompt: list[int], tokens: int = 16) -> list[int]:
    req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(
        max_tokens=tokens, temperature=0.0, ignore_eos=True))
    return [t for resp in stub.Generate(req, timeout=60) for c in resp.choices for t in c.token_ids]


def test_the_front_link_refuses_what_a_front_may_not_send(tiny_llama_dir, tmp_path):
    """On the local link (the scheduler's own fronts' ipc socket): a front naming another front's
    request is dropped; junk frames from an unknown peer are dropped; the core keeps serving."""
    with Stack.running(tiny_llama_dir, tmp_path, secure=False) as s:
        reference = _collect(s.stub, list(range(60, 80)))
        endpoint = _local_link(s)
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        for junk in (b"\x93\x02\x01" + b"\x91" * 1000, b"\xc1", m.TIER.encode(m.Heartbeat(0.0))):
            sock.send(junk)
        sock.send(m.TIER.encode(m.FrontHello("intruder", m.TIER_VERSION)))
        assert sock.poll(5000)
        assert m.TIER.decode(sock.recv()).accepted
        sock.send(m.TIER.encode(m.Abort("local-0.1:someone-else")))
        deadline = time.monotonic() + 30
        while "front intruder dropped (broke the front protocol" not in (tmp_path / "scheduler.log").read_text():
            assert time.monotonic() < deadline, s.logs()
            time.sleep(0.05)
        sock.close()
        assert _collect(s.stub, list(range(60, 80))) == reference
        assert sys.platform.startswith("linux")


def _local_link(stack: Stack) -> str:
    log = (stack.logdir / "scheduler.log").read_text()
    marker = "front link "
    return log[log.rindex(marker) + len(marker):].split()[0].rstrip(",")


def _child(stack: Stack, module: str) -> int:
    out = subprocess.run(["pgrep", "-P", str(stack.scheduler.pid), "-f", module], capture_output=True, text=True)
    return int(out.stdout.split()[0])


def _runs_on(stack: Stack, executor: str, core_pid: int) -> bool:
    """Whether ``executor`` was sent to the engine core of ``core_pid`` (its log says which it joined)."""
    return f"core 1 scheduler_svc.engine.executor_link: executor {executor} joined" in (stack.logdir / "scheduler.log").read_text()


def test_fronts_times_engine_cores_change_no_output_through_preemption_and_losses(tiny_llama_dir, tmp_path):
    """2 fronts x 2 engine cores x 2 executors with small pools: greedy, seeded n = 3, beam search,
    stop strings and preemption give exactly the 1 x 1 x 1 outputs, while one executor is killed
    (its requests move to another executor) and engine core 1 is killed (its requests move to
    core 0, its executor to the directory, and the core is started again)."""
    from tests.process.test_async_scheduling import SMALL_POOL, _workload
    from tests.process.test_async_scheduling import _run as run_all

    reqs = _workload()
    (tmp_path / "one").mkdir()
    s = Stack(tiny_llama_dir, tmp_path / "one")
    try:
        s.start_scheduler()
        s.start_executor("ex", "--kv-cache-memory", SMALL_POOL)
        s.wait_health()
        reference = run_all(s, reqs)
    finally:
        s.stop()
    (tmp_path / "many").mkdir()
    s = Stack(tiny_llama_dir, tmp_path / "many", scheduler_args=["--api-server-count", "2", "--engine-cores", "2"])
    try:
        s.start_scheduler()
        for name in ("ex0", "ex1", "ex2"):
            s.start_executor(name, "--kv-cache-memory", SMALL_POOL)
        s.wait_health()
        s.wait_executors(3)
        core1 = _child(s, "scheduler_svc.entrypoints.core")
        done: dict = {}
        runner = threading.Thread(target=lambda: done.update(run_all(s, reqs)))
        runner.start()
        deadline = time.monotonic() + 60
        while not (on_core1 := [e.id for e in s.stats().executors if _runs_on(s, e.id, core1)]):
            assert time.monotonic() < deadline, "the directory sent engine core 1 no executor"
            time.sleep(0.05)
        on_core0 = next(name for name in s.executors if name not in on_core1)
        while not any(e.id in (*on_core1, on_core0) and e.num_running for e in s.stats().executors):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        subprocess.run(["kill", "-9", str(core1)], check=True)  # mid-run: its requests move to core 0
        s.executors[on_core0].kill()
        runner.join()
        assert done == reference
        log = (s.logdir / "scheduler.log").read_text()
        assert "engine core 1 exited" in log and "sent to the engine core on port" in log
        assert "lost the engine core" in log  # (the fronts moved core 1's requests to core 0)
    finally:
        s.stop()
