"""Several real executor processes: joining mid-load, kill -9, SIGTERM drains, prefix affinity."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest

from pagedserve.v1 import generation_pb2 as pb
from testing.stack import Stack
from testing.waits import wait_for

pytestmark = pytest.mark.slow
OUT_TOKENS = 40


def _prompt(i: int) -> list[int]:
    return [(i * 13 + j * 7) % 480 + 3 for j in range(12 + i % 17)]


def _run_streams(stack: Stack, prompts: list[list[int]], out_tokens: int = OUT_TOKENS,
                 on_progress=None) -> list[list[int] | grpc.RpcError]:
    return stack.stream_all([pb.GenerateRequest(prompt_token_ids=p, sampling=pb.SamplingParams(
        max_tokens=out_tokens, temperature=0.0, ignore_eos=True)) for p in prompts], on_progress)


def _executor_with_work(stack: Stack) -> str:
    holder: list[str] = []

    def busy() -> bool:
        for e in stack.stats().executors:
            if e.state == "ready" and e.num_running > 0 and e.kv_blocks_used > 0:
                holder.append(e.id)
                return True
        return False

    wait_for(busy, 30, "an executor with running requests")
    return holder[0]


def _signal_a_busy_executor(stack: Stack, sig: int, victims: list[str]):
    """An on_progress hook: once 8 streams are under way, signal an executor that holds work."""

    def hook(progress: list[int]) -> None:
        wait_for(lambda: sum(p > 3 for p in progress) >= 8, 60, "streams under way")
        while True:
            victim = _executor_with_work(stack)
            proc = stack.executors[victim]
            if sig == signal.SIGKILL:
                # Frozen, it sends nothing more: once the core has applied what it sent before, requests
                # it still runs are ones the kill leaves unfinished (on a slow machine the clients lag,
                # and a victim picked as its last step ran could finish everything before the kill).
                proc.send_signal(signal.SIGSTOP)
                time.sleep(0.5)
                if not any(e.id == victim and e.num_running for e in stack.stats().executors):
                    proc.send_signal(signal.SIGCONT)
                    continue
            proc.send_signal(sig)
            victims.append(victim)
            return

    return hook


@pytest.fixture(scope="module")
def reference(tiny_llama_dir, tmp_path_factory):
    """Greedy outputs of 32 prompts on a single executor, uninterrupted, with the sequential loop
    (the tests below run the default, asynchronous one: kill -9 and drains must not change a token)."""
    s = Stack(tiny_llama_dir, tmp_path_factory.mktemp("ref"), scheduler_args=["--no-async-scheduling"])
    try:
        s.start_scheduler()
        s.start_executor("solo")
        s.wait_health()
        prompts = [_prompt(i) for i in range(32)]
        outs = _run_streams(s, prompts)
        assert all(isinstance(o, list) and len(o) == OUT_TOKENS for o in outs)
        return prompts, outs
    finally:
        s.stop()


def test_kill_9_mid_stream_loses_nothing(reference, tiny_llama_dir, tmp_path):
    prompts, ref = reference
    s = Stack(tiny_llama_dir, tmp_path)
    try:
        s.start_scheduler()
        for name in ("ex0", "ex1"):
            s.start_executor(name)
        s.wait_executors(2)
        killed: list[str] = []
        outs = _run_streams(s, prompts, on_progress=_signal_a_busy_executor(s, signal.SIGKILL, killed))
        assert killed
        assert [o if isinstance(o, list) else repr(o) for o in outs] == ref
        st = s.stats()
        assert st.num_migrations > 0
        assert [e.id for e in st.executors if e.state != "dead"] == [n for n in ("ex0", "ex1")
                                                                     if n not in killed]
    finally:
        s.stop()


def test_executor_started_mid_load_receives_work(tiny_llama_dir, tmp_path):
    s = Stack(tiny_llama_dir, tmp_path)
    try:
        s.start_scheduler()
        s.start_executor("first")
        s.wait_health()
        seen_late_work, done = threading.Event(), threading.Event()

        def add_executor(progress: list[int]) -> None:
            wait_for(lambda: sum(p > 0 for p in progress) >= 4, 60, "streams under way")
            s.start_executor("late")
            s.wait_executors(2)

        def late_holds_work() -> bool:
            # Running or queued requests, or blocks its finished prompts left in its prefix cache
            # (so that work which came and went between two polls still counts).
            return any(e.id == "late" and (e.num_running or e.num_waiting or e.kv_blocks_cached)
                       for e in s.stats().executors)

        def watch() -> None:
            while not done.is_set() and not seen_late_work.is_set():
                try:
                    if late_holds_work():
                        seen_late_work.set()
                except grpc.RpcError:
                    pass  # (a stats call slow on a busy machine: poll again)
                time.sleep(0.05)

        first = threading.Thread(target=_run_streams, args=(s, [_prompt(i) for i in range(16)], 60),
                                 kwargs={"on_progress": add_executor})
        first.start()
        watcher = threading.Thread(target=watch)
        watcher.start()
        s.wait_executors(2, timeout_s=90)
        outs = _run_streams(s, [_prompt(100 + i) for i in range(16)], 20)
        first.join()
        done.set()
        watcher.join()
        assert all(isinstance(o, list) and len(o) == 20 for o in outs)
        assert seen_late_work.is_set() or late_holds_work(), s.stats()
    finally:
        s.stop()


def test_sigterm_drains_without_failing_a_request(reference, tiny_llama_dir, tmp_path):
    prompts, ref = reference
    s = Stack(tiny_llama_dir, tmp_path)
    try:
        s.start_scheduler()
        for name in ("ex0", "ex1"):
            s.start_executor(name, "--drain-timeout", "30")
        s.wait_executors(2)
        drained: list[str] = []
        outs = _run_streams(s, prompts, on_progress=_signal_a_busy_executor(s, signal.SIGTERM, drained))
        assert [o if isinstance(o, list) else repr(o) for o in outs] == ref
        assert s.executors[drained[0]].wait(timeout=60) == 0  # it exited by itself, cleanly
        outs = _run_streams(s, prompts[:4])  # new work goes to the survivor only
        assert outs == ref[:4]
    finally:
        s.stop()


def test_migration_limit_fails_with_unavailable(tiny_llama_dir, tmp_path):
    s = Stack(tiny_llama_dir, tmp_path, scheduler_args=["--max-migrations", "0"])
    try:
        s.start_scheduler()
        s.start_executor("only")
        s.wait_health()

        def kill(progress: list[int]) -> None:
            wait_for(lambda: all(p > 2 for p in progress), 60, "streams under way")
            s.executors["only"].send_signal(signal.SIGKILL)

        outs = _run_streams(s, [_prompt(i) for i in range(4)], 400, on_progress=kill)
        for o in outs:
            assert isinstance(o, grpc.RpcError) and o.code() == grpc.StatusCode.UNAVAILABLE
            assert "max_migrations" in o.details()
    finally:
        s.stop()


def test_shared_prefixes_land_where_they_are_cached(tiny_llama_dir, tmp_path):
    """4 long prefixes x 12 requests over 3 executors: hits far above random routing's 1/3."""
    s = Stack(tiny_llama_dir, tmp_path)
    try:
        s.start_scheduler()
        for name in ("a", "b", "c"):
            s.start_executor(name)
        s.wait_executors(3)
        prefixes = [[(p * 101 + j * 3) % 480 + 3 for j in range(128)] for p in range(4)]
        cached = eligible = 0
        max_skew = 0
        for wave in range(3):
            prompts = [prefixes[i % 4] + [400 + wave, 401 + i] for i in range(16)]
            usage: list = [None] * len(prompts)

            def run(i: int, prompts: list[list[int]], usage: list) -> None:
                req = pb.GenerateRequest(prompt_token_ids=prompts[i], sampling=pb.SamplingParams(
                    max_tokens=8, temperature=0.0, ignore_eos=True))
                for resp in s.stub.Generate(req, timeout=120):
                    if resp.HasField("usage"):
                        usage[i] = resp.usage

            threads = [threading.Thread(target=run, args=(i, prompts, usage)) for i in range(len(prompts))]
            for t in threads:
                t.start()
            while any(t.is_alive() for t in threads):
                loads = [e.num_running + e.num_waiting for e in s.stats().executors]
                max_skew = max(max_skew, max(loads) - min(loads))
                time.sleep(0.05)
            if wave > 0:  # the first wave fills the caches
                cached += sum(u.cached_prompt_tokens for u in usage)
                eligible += sum(128 for _ in usage)
        hit_rate = cached / eligible
        print(f"prefix hit rate with 3 executors: {hit_rate:.2f} (random routing ~0.33); "
              f"max load skew {max_skew}")
        assert hit_rate > 0.8
        assert max_skew <= 8 + 16 * 0.5  # routing.SKEW_ABS / SKEW_REL bound
    finally:
        s.stop()


def test_an_executor_whose_old_connection_hangs_gets_its_id_back(tiny_llama_dir, tmp_path):
    """A frozen or cut-off node sends no FIN, so its connection stays open; the routing id is not
    handed over to a newcomer. libzmq's heartbeat closes the silent connection, and the restarted
    executor (same id, as a recreated pod keeps its name) registers again."""
    s = Stack(tiny_llama_dir, tmp_path)
    frozen = None
    try:
        s.start_scheduler()
        frozen = s.start_executor("ex0")
        s.wait_executors(1)
        frozen.send_signal(signal.SIGSTOP)  # alive to the kernel, silent to everyone
        deadline = time.monotonic() + 30
        while [e.id for e in s.stats().executors]:
            assert time.monotonic() < deadline, "the frozen executor was never declared dead"
            time.sleep(0.1)
        s.start_executor("ex0")  # its restart, under the same id
        s.wait_executors(1, timeout_s=30)
        req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=pb.SamplingParams(
            max_tokens=4, temperature=0.0, ignore_eos=True))
        assert sum(len(c.token_ids) for r in s.stub.Generate(req, timeout=60) for c in r.choices) == 4
    finally:
        if frozen is not None:
            frozen.kill()
            frozen.wait(10)
        s.stop()
