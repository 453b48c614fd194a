"""The executor's compute thread: start-up work runs on it, then the plans of the runner it built.

Why one thread matters (an OpenMP pool per thread that starts parallel work) is in
executor_svc/worker.py; these tests hold the contract that gives it: what ``call`` runs and
what the worker's plans run on is the same thread, and a start-up failure reaches the caller.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from executor_svc.worker import _STOP, ComputeThread, ExecutorWorker
from pagedserve import wire
from scheduler_svc.engine.engine_config import EngineConfig
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing.fake_engine import BLOCKS, FakeRunner, collect, req, run, settle
from testing.grpc_fakes import make_tokenizer
from testing.in_process_engine import Engine


class _ThreadRecordingRunner(FakeRunner):
    """Records the thread it was built on and each thread a plan ran on."""

    def __init__(self, vocab: int) -> None:
        self.built_on = threading.get_ident()
        self.ran_on: set[int] = set()
        super().__init__(vocab)

    def execute(self, plan: wire.BatchPlan) -> wire.StepResult:
        self.ran_on.add(threading.get_ident())
        return super().execute(plan)


def test_call_runs_on_the_compute_thread_and_raises_what_the_work_raised():
    compute = ComputeThread()
    assert compute.call(threading.get_ident) == compute.ident != threading.get_ident()

    def fails() -> None:
        raise FileNotFoundError("no config.json")

    with pytest.raises(FileNotFoundError, match="no config.json"):
        compute.call(fails)
    assert compute.call(lambda a, b: a + b, 2, 3) == 5  # the thread outlives a failed call
    compute.inbox.put((-1, _STOP))
    compute.join(5)
    assert not compute.is_alive()


def test_the_worker_runs_plans_on_the_thread_that_built_the_runner():
    tokenizer = make_tokenizer()

    async def main():
        cfg = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256),
                           executor_endpoint="tcp://127.0.0.1:0", heartbeat_interval_s=0.2)
        engine = Engine(cfg, tokenizer, eos_token_ids=())
        await engine.start()
        compute = ComputeThread()
        runner = compute.call(_ThreadRecordingRunner, tokenizer.get_vocab_size())
        hs = wire.Handshake("built", wire.WIRE_VERSION, "fake", "fake-model", "FakeForCausalLM",
                            tokenizer.get_vocab_size(), 16, BLOCKS, 16, 1024, "float32", "cpu")
        worker = ExecutorWorker(f"tcp://127.0.0.1:{engine.hub.bound_port}", runner, hs, compute=compute)
        serving = threading.Thread(target=worker.run, daemon=True)
        serving.start()
        try:
            while not engine.slots:
                await asyncio.sleep(0.01)
            tokens, *_ = await collect(engine, req("r", list(range(3, 30)), 8))
            assert len(tokens[0]) == 8
            await settle(engine)
        finally:
            await engine.shutdown(0)
            worker.request_drain()
            worker.request_drain()  # the second signal: exit at once
            serving.join(5)
        assert runner.built_on == compute.ident
        assert runner.ran_on == {compute.ident}
        assert worker.compute is compute
        with pytest.raises(RuntimeError, match="serves plans"):  # not left waiting behind the plans
            compute.call(threading.get_ident)

    run(main())
