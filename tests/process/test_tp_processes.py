"""Tensor-parallel executors as real processes behind the real scheduler, over gRPC.

One command starts a 2-rank group (the leader starts its follower); the scheduler sees one
executor of tensor_parallel_size 2. A kill -9 of either rank takes the group out of service
within the heartbeat timeout, nothing is left running, and its requests finish on another
executor exactly as if uninterrupted. SIGTERM to a follower drains the whole group. Ranks
started by hand (the multi-node form: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) that disagree
about the block size refuse to start, saying why.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from pagedserve import wire
from pagedserve.v1 import generation_pb2 as pb
from testing.stack import Stack, free_port

pytestmark = pytest.mark.slow
HEARTBEAT_S = 0.5  # testing/stack.py's scheduler
OUT_TOKENS = 24


@pytest.fixture(scope="module")
def tp_model(tiny_checkpoint) -> Path:
    return tiny_checkpoint("llama", "tp")


@pytest.fixture(scope="module")
def hf(tp_model):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tp_model, dtype=torch.float32).eval()


def _prompt(i: int) -> list[int]:
    return [(i * 13 + j * 7) % 480 + 3 for j in range(10 + i % 13)]


def _hf_greedy(hf, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _generate(stack: Stack, prompt: list[int], sampling: pb.SamplingParams) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for resp in stack.stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=sampling), timeout=120):
        for c in resp.choices:
            tokens.setdefault(c.index, []).extend(c.token_ids)
    return tokens


def _greedy(max_tokens: int = OUT_TOKENS, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def _children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(x) for x in text.split()]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"  # a zombie still awaits its parent


def _wait(cond, timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout_s:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)
    return time.monotonic() - start


def _state(stack: Stack, name: str) -> str:
    return next((e.state for e in stack.stats().executors if e.id == name), "absent")


@pytest.fixture(scope="module")
def tp_stack(tp_model, tmp_path_factory):
    s = Stack(tp_model, tmp_path_factory.mktemp("tp"))
    try:
        s.start_scheduler()
        s.start_executor("tp", "--tensor-parallel-size", "2")
        s.wait_health()
        yield s
    finally:
        s.stop()


def test_one_executor_of_two_ranks_serves_exact_greedy_beams_and_choices(tp_stack, hf):
    (ex,) = tp_stack.stats().executors
    assert (ex.id, ex.tensor_parallel_size) == ("tp", 2)
    assert len(_children(tp_stack.executors["tp"].pid)) == 1  # the follower, started by the leader
    for i in range(3):
        assert _generate(tp_stack, _prompt(i), _greedy())[0] == _hf_greedy(hf, _prompt(i), OUT_TOKENS)
    prompt = _prompt(5)
    assert _generate(tp_stack, prompt, _greedy(8, n=2)) == {0: _hf_greedy(hf, prompt, 8), 1: _hf_greedy(hf, prompt, 8)}
    beams = _generate(tp_stack, prompt, pb.SamplingParams(max_tokens=8, beam_width=2, ignore_eos=True))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), num_beams=2, num_return_sequences=2, do_sample=False,
                          early_stopping=False, max_new_tokens=8, eos_token_id=None, pad_token_id=0)
    assert [beams[0], beams[1]] == ref[:, len(prompt):].tolist()
    # SIGTERM to the leader drains the group: both ranks exit 0, nothing is left running.
    leader = tp_stack.executors["tp"]
    (follower,) = _children(leader.pid)
    leader.send_signal(signal.SIGTERM)
    assert leader.wait(timeout=30) == 0
    _wait(lambda: _gone(follower), 10, "the follower gone")


def _streams(stack: Stack, prompts: list[list[int]], on_progress) -> list:
    results: list = [None] * len(prompts)
    progress = [0] * len(prompts)

    def run(i: int) -> None:
        try:
            for resp in stack.stub.Generate(pb.GenerateRequest(prompt_token_ids=prompts[i], sampling=_greedy()),
                                            timeout=180):
                results[i] = (results[i] or []) + [t for c in resp.choices for t in c.token_ids]
                progress[i] = len(results[i])
        except grpc.RpcError as e:
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    on_progress(progress)
    for t in threads:
        t.join()
    return results


@pytest.mark.parametrize("victim", ["follower", "leader"])
def test_kill_9_of_any_rank_takes_the_group_out_and_its_requests_move(tp_model, hf, tmp_path, victim):
    s = Stack(tp_model, tmp_path)
    try:
        s.start_scheduler()
        s.start_executor("tp", "--tensor-parallel-size", "2")
        s.wait_executors(1)
        s.start_executor("solo")
        s.wait_executors(2)
        leader = s.executors["tp"]
        (follower,) = _children(leader.pid)
        prompts = [_prompt(i) for i in range(12)]
        took: list[float] = []

        def kill(progress: list[int]) -> None:
            _wait(lambda: any(e.id == "tp" and e.num_running > 0 for e in s.stats().executors) and
                  sum(p > 2 for p in progress) >= 6, 60, "the group running requests")
            os.kill(follower if victim == "follower" else leader.pid, signal.SIGKILL)
            took.append(_wait(lambda: _state(s, "tp") in ("dead", "absent"), 30, "the group declared dead"))

        outs = _streams(s, prompts, kill)
        assert [o if isinstance(o, list) else repr(o) for o in outs] == [_hf_greedy(hf, p, OUT_TOKENS) for p in prompts]
        assert s.stats().num_migrations > 0
        # Out of service within the heartbeat timeout (5 silent intervals), plus one interval for
        # the scheduler's next send that finds the peer gone.
        print(f"group out of service {took[0]:.2f}s after kill -9 of the {victim}")
        assert took[0] <= (wire.DEAD_AFTER_INTERVALS + 1) * HEARTBEAT_S, took
        _wait(lambda: _gone(follower), 10, "the follower gone")
        if victim == "follower":  # the leader notices (a failed collective or its watchdog) and says so
            assert leader.wait(timeout=10) == 3
            assert "leaving the group (exit 3)" in (tmp_path / "tp.log").read_text()
        else:
            leader.wait(timeout=10)
    finally:
        s.stop()


def _log_tails(where: Path, *names: str, lines: int = 40) -> str:
    """What a failed assertion shows of the ranks' own logs (a traceback, a fatal signal's dump)."""
    return "\n".join(f"--- {n}:\n" + "\n".join((where / n).read_text(errors="replace").splitlines()[-lines:])
                     for n in names)


def _rank(model: Path, rank: int, port: int, scheduler_port: int, log: Path, *extra: str) -> subprocess.Popen:
    """One rank started by hand, as on a node of a multi-node group."""
    env = dict(os.environ, RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "executor_svc", "--model", str(model), "--scheduler",
            f"tcp://127.0.0.1:{scheduler_port}", "--tensor-parallel-size", "2", "--executor-id", "tp",
            "--kv-cache-memory", "16MiB", "--swap-space", "1MiB", "--health-port", "0", *extra]
    with open(log, "wb") as out:  # the child keeps its own descriptor
        return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)


def test_sigterm_to_a_follower_drains_the_whole_group(tp_model, hf, tmp_path):
    s = Stack(tp_model, tmp_path)
    try:
        s.start_scheduler()
        port = free_port()
        ranks = [_rank(tp_model, r, port, s.executor_port, tmp_path / f"rank{r}.log", "--drain-timeout", "30",
                       *s.executor_key_args("tp")) for r in (0, 1)]
        s.executors.update({"rank0": ranks[0], "rank1": ranks[1]})  # stopped with the stack
        s.wait_executors(1)
        s.start_executor("solo")
        s.wait_executors(2)
        prompts = [_prompt(20 + i) for i in range(8)]

        def term(progress: list[int]) -> None:
            _wait(lambda: any(e.id == "tp" and e.num_running > 0 for e in s.stats().executors), 60, "work on tp")
            ranks[1].send_signal(signal.SIGTERM)

        outs = _streams(s, prompts, term)
        assert outs == [_hf_greedy(hf, p, OUT_TOKENS) for p in prompts]  # nothing failed, nothing lost
        codes = [r.wait(timeout=60) for r in ranks]
        assert codes == [0, 0], _log_tails(tmp_path, "rank0.log", "rank1.log")  # both drained and exited cleanly
        assert "asked for a drain" in (tmp_path / "rank0.log").read_text()
    finally:
        s.stop()


def test_ranks_that_disagree_refuse_to_start_and_say_why(tp_model, tmp_path):
    port = free_port()
    ranks = [_rank(tp_model, r, port, free_port(), tmp_path / f"rank{r}.log", "--block-size", str(16 * (r + 1)))
             for r in (0, 1)]
    try:
        assert [r.wait(timeout=60) for r in ranks] == [1, 1]
    finally:
        for r in ranks:
            r.kill()
    for r in (0, 1):
        assert "rank 1 has --block-size '32' but rank 0 has '16'" in (tmp_path / f"rank{r}.log").read_text()


def test_a_model_that_cannot_split_refuses_before_starting_any_rank(tp_model, tmp_path):
    out = subprocess.run([sys.executable, "-m", "executor_svc", "--model", str(tp_model), "--scheduler",
                          "tcp://127.0.0.1:1", "--tensor-parallel-size", "3", "--health-port", "0"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1
    assert "--tensor-parallel-size 3: the model's 8 attention heads" in out.stderr
    assert "started tensor-parallel rank" not in out.stderr
