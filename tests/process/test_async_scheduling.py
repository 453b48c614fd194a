"""Asynchronous scheduling changes no output: the same requests through real services give the
same tokens and text with the overlapped loop (the default) and the sequential one.

The workload mixes what planning ahead has to get right: greedy decoding, seeded sampling with
n > 1 (copy-on-write of the shared prompt block), beam search (which cannot be planned ahead),
stop strings (found in text, after the next plan may be built) and a KV pool small enough that
requests are preempted, by recompute and by swap, while their samples are in flight.
"""

from __future__ import annotations

import threading

import grpc
import pytest

from pagedserve.v1 import generation_pb2 as pb
from testing.stack import Stack

pytestmark = pytest.mark.slow
SMALL_POOL = "320KiB"  # 40 blocks of the small tiny model: 16 concurrent requests preempt each other


def _workload() -> list[pb.GenerateRequest]:
    reqs = []
    for i in range(10):
        prompt = [(7 * i + 3 * j) % 400 + 5 for j in range(12 + 3 * i)]
        reqs.append(pb.GenerateRequest(request_id=f"greedy-{i}", prompt_token_ids=prompt, sampling=pb.SamplingParams(
            max_tokens=24 + i, temperature=0.0, ignore_eos=True)))
    for i in range(2):
        reqs.append(pb.GenerateRequest(request_id=f"n3-{i}", prompt_token_ids=[11 + i] * 21, sampling=pb.SamplingParams(
            max_tokens=20, temperature=0.9, top_p=0.9, seed=100 + i, n=3, ignore_eos=True)))
    for i in range(2):
        reqs.append(pb.GenerateRequest(request_id=f"beam-{i}", prompt_token_ids=[31 + i, 9, 40, 2, 77],
                                       sampling=pb.SamplingParams(max_tokens=12, beam_width=3)))
    for i in range(3):
        reqs.append(pb.GenerateRequest(request_id=f"stop-{i}", prompt_token_ids=[50 + i] * (9 + i),
                                       sampling=pb.SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                                  stop=["e", "a"])))
    return reqs


def _run(stack: Stack, reqs: list[pb.GenerateRequest]) -> dict[str, tuple]:
    out: dict[str, tuple] = {}
    start = threading.Barrier(len(reqs))  # all at once: the small pool must run short

    def one(req: pb.GenerateRequest) -> None:
        toks: dict[int, list[int]] = {}
        text: dict[int, str] = {}
        finish: dict[int, int] = {}
        start.wait()
        try:
            for resp in stack.stub.Generate(req, timeout=180):
                for c in resp.choices:
                    toks.setdefault(c.index, []).extend(c.token_ids)
                    text[c.index] = text.get(c.index, "") + c.text
                    if c.finish_reason:
                        finish[c.index] = c.finish_reason
            out[req.request_id] = (toks, text, finish)
        except grpc.RpcError as e:
            out[req.request_id] = (e.code(), e.details())

    threads = [threading.Thread(target=one, args=(r,)) for r in reqs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


@pytest.fixture(scope="module")
def outputs(tiny_llama_dir, tmp_path_factory) -> dict[tuple, tuple[dict, int]]:
    """(outputs, preemptions) per configuration, each on a fresh stack with a small KV pool."""
    reqs = _workload()
    results = {}
    configs = [(mode, loop, ()) for mode in ("recompute", "swap") for loop in ("--no-async-scheduling",
                                                                               "--async-scheduling")]
    configs.append(("recompute", "--async-scheduling", ("--prepare-ahead",)))  # on CPU only when asked
    configs.append(("recompute", "--async-scheduling", ("--decode-steps", "1")))  # (the default: 8)
    for mode, loop, executor_args in configs:
        s = Stack(tiny_llama_dir, tmp_path_factory.mktemp(f"{mode}{loop}{''.join(executor_args)}"),
                  scheduler_args=["--preemption-mode", mode, loop])
        try:
            s.start_scheduler()
            s.start_executor("ex", "--kv-cache-memory", SMALL_POOL, *executor_args)
            s.wait_health()
            results[(mode, loop, *executor_args)] = (_run(s, reqs), s.stats())
            s.wait_blocks_free()
            ahead = "prepared while the step before it runs" in (s.logdir / "ex.log").read_text()
            assert ahead == ("--prepare-ahead" in executor_args)  # the CPU executor prepares ahead only when asked
        finally:
            s.stop()
    return results


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_async_and_sync_loops_give_identical_outputs_under_preemption(outputs, mode):
    sync, sync_stats = outputs[(mode, "--no-async-scheduling")]
    overlapped, async_stats = outputs[(mode, "--async-scheduling")]
    assert not [k for k, v in sync.items() if len(v) != 3], sync  # nothing failed
    assert sync_stats.num_preemptions > 0 and async_stats.num_preemptions > 0, "the pool never ran short"
    assert overlapped == sync
    stopped = [k for k, (_, _, finish) in sync.items() if k.startswith("stop") and finish[0] == pb.FINISH_REASON_STOP]
    assert stopped, "no stop string matched: the stop-string case was not exercised"


def test_an_executor_preparing_each_plan_ahead_gives_identical_outputs(outputs):
    """--prepare-ahead (executor_svc/pipeline.py; the default on GPUs) forced on the CPU executor."""
    ahead, stats = outputs[("recompute", "--async-scheduling", "--prepare-ahead")]
    assert stats.num_preemptions > 0
    assert ahead == outputs[("recompute", "--no-async-scheduling")][0]


def test_one_decode_step_per_plan_gives_identical_outputs(outputs):
    """The executor's --decode-steps (several decode steps per plan once every running request decodes
    plainly and none waits: the tail of this workload) against one step per plan."""
    one, stats = outputs[("recompute", "--async-scheduling", "--decode-steps", "1")]
    assert stats.num_preemptions > 0
    assert one == outputs[("recompute", "--async-scheduling")][0]


def test_preemption_mode_does_not_change_outputs_either(outputs):
    assert outputs[("recompute", "--async-scheduling")][0] == outputs[("swap", "--async-scheduling")][0]
