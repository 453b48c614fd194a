"""A request's way out of the engine core, however it ends (client gone, executor lost, a stop string
while it moves): nothing of it is left computing, and the gauges (running, waiting, swapped, KV usage)
follow. The engine with in-process fake executors, as tests/unit/engine/test_engine.py."""

from __future__ import annotations

import asyncio
import time

import pytest
from tokenizers import Tokenizer

from pagedserve.engine_api import EngineError, ErrorKind, GenerationRequest, RequestParams
from pagedserve.wire import SamplingParams
from scheduler_svc.telemetry.metrics import Metrics
from testing.fake_engine import collect, engine_executor, req, run, running, settle
from testing.grpc_fakes import make_tokenizer

GAUGES = ("pagedserve:num_requests_running", "pagedserve:num_requests_waiting", "pagedserve:num_requests_swapped")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return make_tokenizer()


async def _until(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g}s waiting for {what}"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("end", ["orphan timeout", "client cancel"])
def test_the_gauges_return_to_zero_when_the_only_executor_dies_and_its_requests_end(tokenizer, end):
    """No loop is left to refresh the gauges once the last executor is gone: they must not keep
    reporting the requests it ran (nor its KV usage), neither while those wait for another executor
    nor after they failed (--orphan-timeout) or their clients left."""
    async def main():
        metrics = Metrics()
        value = metrics.registry.get_sample_value
        timeout = 0.5 if end == "orphan timeout" else 60.0
        async with running(tokenizer, 0, metrics=metrics, orphan_timeout_s=timeout) as (engine, execs):
            execs.append(engine_executor(engine, "only", step_s=0.01))
            await _until(lambda: "only" in engine.slots, 30, "the executor to register")
            tasks = [asyncio.create_task(collect(engine, req(f"k{i}", list(range(3, 40)), 500))) for i in range(3)]
            await _until(lambda: value("pagedserve:num_requests_running") == 3, 30, "the gauges to show 3 running")
            execs[0].kill()
            await _until(lambda: value("pagedserve:num_requests_running") == 0
                         and value("pagedserve:num_requests_waiting") == 3, 10, "3 waiting for an executor")
            assert value("pagedserve:kv_cache_usage_perc", {"executor": "only"}) is None  # gone with it
            if end == "client cancel":
                for t in tasks:
                    t.cancel()
            for outcome in await asyncio.gather(*tasks, return_exceptions=True):
                if end == "client cancel":
                    assert isinstance(outcome, asyncio.CancelledError), outcome
                else:
                    assert isinstance(outcome, EngineError) and outcome.kind is ErrorKind.NO_EXECUTOR, outcome
            await _until(lambda: all(value(g) == 0 for g in GAUGES), 10, f"{GAUGES} back to 0")
            assert engine.stats().num_running == engine.stats().num_waiting == 0 and not engine.core.orphans

    run(main())


def test_a_choice_a_stop_string_ended_while_its_request_moves_is_not_computed_on_elsewhere(tokenizer):
    """The front's FinishChoice can reach the core while the request waits to be placed again (its
    executor lost, the flush before the move carried the stop string's tokens): the new executor must
    not compute that choice on to max_tokens for a client that no longer reads it."""
    async def main():
        async with running(tokenizer, 0, orphan_timeout_s=60.0) as (engine, execs):
            execs.append(engine_executor(engine, "lost", step_s=0.01))
            await _until(lambda: "lost" in engine.slots, 30, "the executor to register")
            r = GenerationRequest("two", list(range(3, 30)), RequestParams(
                max_tokens=400, sampling=SamplingParams(temperature=1.0, seed=7), n=2, ignore_eos=True))
            task = asyncio.create_task(collect(engine, r))
            sched = engine.slots["lost"].scheduler
            await _until(lambda: "two" in sched.requests and len(sched.requests["two"].live) == 2
                         and sched.requests["two"].live[0].num_output_tokens >= 3, 30, "both choices decoding")
            execs[0].kill()
            await _until(lambda: [cr.request_id for cr in engine.core.orphans] == ["two"], 10,
                         "the request to wait for another executor")
            engine.core.finish_choice("two", 0)  # as the front does when a stop string ends choice 0
            execs.append(engine_executor(engine, "next", step_s=0.01))
            await _until(lambda: "next" in engine.slots and "two" in engine.slots["next"].scheduler.requests, 30,
                         "the request to resume on the next executor")
            assert [s.index for s in engine.slots["next"].scheduler.requests["two"].live] == [1]
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await settle(engine)

    run(main())


def test_a_request_past_its_clients_deadline_is_ended_by_the_core(tokenizer):
    """A front cancels a gRPC call at its deadline; the core ends the request at the same deadline
    too, so that a front that no longer does (stuck, or its cancel lost) leaves no request computing
    for nobody. The others run on; nothing is left behind."""
    async def main():
        async with running(tokenizer, 0) as (engine, execs):
            execs.append(engine_executor(engine, "slow", step_s=0.01))
            await _until(lambda: "slow" in engine.slots, 30, "the executor to register")
            late = req("late", list(range(3, 30)), 500)
            late.deadline = time.monotonic() + 0.3
            done_in_time = req("in-time", list(range(3, 30)), 3)
            done_in_time.deadline = time.monotonic() + 60  # its timer goes when it finishes
            other = asyncio.create_task(collect(engine, req("other", list(range(5, 30)), 60)))
            assert len((await collect(engine, done_in_time))[0][0]) == 3
            with pytest.raises(EngineError) as raised:
                await collect(engine, late)
            assert raised.value.kind is ErrorKind.DEADLINE
            assert "its deadline passed" in str(raised.value)
            assert len((await other)[0][0]) == 60
            await settle(engine)

    run(main())
