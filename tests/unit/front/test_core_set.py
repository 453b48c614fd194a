"""A front's choice of engine core (front/core_set.py): what a request hears when no core takes it."""

from __future__ import annotations

import pytest

from pagedserve.engine_api import (
    EngineError,
    EngineStats,
    ErrorKind,
    ExecutorStats,
    GenerationRequest,
    ModelInfo,
    RequestParams,
)
from scheduler_svc.front.core_set import CoreSet


class FakeCore:
    """What CoreSet reads of a RemoteCore: reachability, readiness and the last Status's stats."""

    def __init__(self, connected: bool, ready: bool, executor_states: tuple[str, ...]) -> None:
        self.connected, self.ready, self.endpoint = connected, ready, "ipc://fake"
        self.executors = [ExecutorStats(f"e{i}", s, 10, 0, 0, 0, 0, 0) for i, s in enumerate(executor_states)]

    def attach(self, core_set) -> None:
        pass

    def is_ready(self) -> bool:
        return self.connected and self.ready

    def stats(self) -> EngineStats:
        return EngineStats(executors=self.executors)

    def model_info(self) -> ModelInfo:
        return ModelInfo("m", "LlamaForCausalLM", 64, 100, 16, len(self.executors))


@pytest.mark.parametrize(("cores", "message"), [
    ([FakeCore(False, False, ())], "no engine core is reachable; try again"),
    ([FakeCore(True, False, ("draining",))],
     "the executors are all draining (1: each finishes its requests, then leaves); try again once another has "
     "registered"),
    ([FakeCore(True, False, ("draining", "dead")), FakeCore(True, False, ("draining",))],
     "the executors are all draining (2: each finishes its requests, then leaves); try again once another has "
     "registered"),
    ([FakeCore(True, False, ())], "no executor is connected to the engine core; try again once one has registered"),
    ([FakeCore(True, False, ("ready",))], "no engine core is ready (it may be shutting down); try again"),
])
def test_a_request_no_core_takes_hears_why(cores, message):
    with pytest.raises(EngineError) as exc:
        CoreSet(cores).submit(GenerationRequest(request_id="r", prompt_token_ids=[1, 2], params=RequestParams(max_tokens=4)), None)
    assert (exc.value.kind, str(exc.value)) == (ErrorKind.NO_EXECUTOR, message)


def test_scrapes_of_the_deployments_metrics_share_one_ask_of_the_core_per_ttl(monkeypatch):
    """/metrics on the API port is open: a flood of scrapes reaches the core's loop once per TTL."""
    import asyncio
    from types import SimpleNamespace

    from scheduler_svc.front import core_set

    class Answers(FakeCore):
        asks = 0
        fail = False

        async def metrics_text(self, timeout_s: float) -> str:
            Answers.asks += 1
            await asyncio.sleep(0.01)
            if Answers.fail:
                raise TimeoutError
            return f"text {Answers.asks}"

    clock = [100.0]
    monkeypatch.setattr(core_set, "time", SimpleNamespace(monotonic=lambda: clock[0]))  # (not the loop's clock)
    cores = CoreSet([Answers(True, True, ("ready",))])

    async def scrapes(n: int) -> list:
        return await asyncio.gather(*(cores.metrics_text() for _ in range(n)), return_exceptions=True)

    async def run() -> None:
        assert await scrapes(20) == ["text 1"] * 20 and Answers.asks == 1  # one ask for all in flight
        assert await scrapes(5) == ["text 1"] * 5 and Answers.asks == 1  # fresh: no ask
        clock[0] += core_set.EXPOSITION_TTL_S + 0.01
        Answers.fail = True
        got = await scrapes(3)
        assert all(isinstance(g, TimeoutError) for g in got) and Answers.asks == 2  # (the front's 503)
        Answers.fail = False
        assert await scrapes(2) == ["text 3"] * 2  # a failed ask is not kept: the next asks again

    asyncio.run(run())
