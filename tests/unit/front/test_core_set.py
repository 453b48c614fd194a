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
