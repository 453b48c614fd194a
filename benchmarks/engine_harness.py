"""What the engine benchmarks share: executor worker processes over the simulated executor, the
tokenizer they detokenize with, and a consumer that drains ``Engine.generate`` as a gRPC handler does.

``benchmarks/executor_scaling.py`` sleeps each step for the OPT-13B cost model's time;
``benchmarks/step_overlap.py`` for a constant time, and counts how long each executor was busy.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import time
from collections.abc import AsyncIterator

from pagedserve import wire
from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.wire import SamplingParams
from scheduler_svc.engine.engine_config import EngineConfig
from testing.in_process_engine import Engine
from testing.sim.executor import CostModel, SimExecutor

SIM_BLOCKS = 8192  # per executor: room for 256 sequences of 2k tokens, so no preemption

# What a SleepingRunner counts in its shared ``stats`` array (the benchmark reads it, and zeroes it
# to start a window). The first four are step_overlap's; a longer array also gets the plan delays:
# a plan's delay is the time from the end of the step before it (its result is sent then) to this
# step's start. With asynchronous scheduling the next plan is normally queued by then: a delay is
# what the scheduler's loop (or a machine short of CPU) added. The window's first step has none.
BUSY_S, FIRST_START, LAST_END, STEPS = 0, 1, 2, 3
MAX_DELAY_S, DELAY_SUM_S, DELAYS_OVER_1MS, DELAYS_OVER_5MS, TOKENS, LAST_SAMPLED = 4, 5, 6, 7, 8, 9
STATS_LEN = 10


class SleepingRunner:
    """The worker's runner interface over SimExecutor, taking the step's time for real: the cost
    model's, or ``step_s``, or the current value of ``step_time`` (a shared ``mp.Value``: the
    benchmark changes it between phases). ``stats`` (shared with the benchmark process), when
    given: the counters above."""

    def __init__(self, vocab: int, eos: int | None, step_s: float | None = None, stats=None,
                 step_time=None, text_ids: list[int] | None = None) -> None:
        self.vocab, self.eos, self.step_s, self.stats, self.step_time = vocab, eos, step_s, stats, step_time
        self.text_ids = text_ids  # what the sequences "generate" (SimExecutor.text_ids); None: random ids
        self.reset()

    def reset(self) -> None:
        self.sim = SimExecutor(CostModel(), eos_token_id=self.eos, vocab_size=self.vocab, text_ids=self.text_ids)

    def execute(self, plan: wire.BatchPlan) -> wire.StepResult:
        start = time.perf_counter()
        result = self.sim.execute(plan)
        step_s = self.step_s if self.step_time is None else self.step_time.value
        step_s = result.model_seconds if step_s is None else step_s
        time.sleep(max(0.0, step_s - (time.perf_counter() - start)))
        if (st := self.stats) is not None:
            end = time.perf_counter()
            with st.get_lock():
                if len(st) >= STATS_LEN:
                    st[TOKENS] += len(result.sampled_token_ids)
                    st[LAST_SAMPLED] = len(result.sampled_token_ids)
                    if st[STEPS]:
                        _count_delay(st, start - st[LAST_END])
                st[BUSY_S] += end - start
                st[FIRST_START] = start if st[STEPS] == 0 else st[FIRST_START]
                st[LAST_END] = end
                st[STEPS] += 1
        return result


def _count_delay(st, delay: float) -> None:
    st[MAX_DELAY_S] = max(st[MAX_DELAY_S], delay)
    st[DELAY_SUM_S] += delay
    st[DELAYS_OVER_1MS] += delay > 1e-3
    st[DELAYS_OVER_5MS] += delay > 5e-3


def executor_process(endpoint: str, name: str, vocab: int, eos: int | None, step_s: float | None = None,
                     stats=None, step_time=None, max_model_len: int = 4096, num_blocks: int = SIM_BLOCKS,
                     text_ids: list[int] | None = None) -> None:
    """A real ExecutorWorker (ZeroMQ, handshake, heartbeats) around a SleepingRunner: a process target."""
    from executor_svc.worker import ExecutorWorker

    hs = wire.Handshake(executor_id=name, wire_version=wire.WIRE_VERSION, model_fingerprint="sim",
                        model_name="sim", architecture="SimExecutor", vocab_size=vocab, block_size=16,
                        num_device_blocks=num_blocks, num_cpu_blocks=0, max_model_len=max_model_len,
                        dtype="float16", device="sim")
    runner = SleepingRunner(vocab, eos, step_s, stats, step_time, text_ids)
    ExecutorWorker(endpoint, runner, hs, drain_timeout=1.0).run()


async def consume(engine: Engine, req: GenerationRequest) -> int:
    """Drain one request's stream; return how many tokens it streamed."""
    n = 0
    async for out in engine.generate(req):
        for c in out.choices:
            n += len(c.token_ids)
    return n


def distinct_requests(count: int, vocab: int, prompt_len: int, output_len: int,
                      tag: str = "r") -> list[GenerationRequest]:
    """Greedy requests ignoring EOS whose first two tokens differ: no accidental prefix sharing
    steers the routing."""
    return [GenerationRequest(f"{tag}-{i}", [5 + i % 400, 5 + i // 400] +
                              [(i * 31 + j) % (vocab - 10) + 5 for j in range(prompt_len - 2)],
                              RequestParams(max_tokens=output_len, sampling=SamplingParams(temperature=0.0),
                                            ignore_eos=True))
            for i in range(count)]


@contextlib.asynccontextmanager
async def engine_with_executors(cfg: EngineConfig, tok, eos: int | None, num_executors: int, metrics=None,
                                step_s: float | None = None, stats: list | None = None) -> AsyncIterator[Engine]:
    """A started engine with ``num_executors`` executor processes registered and ready; all
    stopped on exit. ``stats[i]``: executor i's busy counters (see SleepingRunner)."""
    engine = Engine(cfg, tok, () if eos is None else (eos,), metrics)
    await engine.start()
    endpoint = f"tcp://127.0.0.1:{engine.hub.bound_port}"
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=executor_process, daemon=True,
                         args=(endpoint, f"sim{i}", tok.get_vocab_size(), eos, step_s, stats[i] if stats else None))
             for i in range(num_executors)]
    for p in procs:
        p.start()
    try:
        while sum(s.conn.state == "ready" for s in engine.slots.values()) < num_executors:
            await asyncio.sleep(0.05)
        yield engine
    finally:
        await engine.shutdown(0.0)
        for p in procs:
            p.terminate()
            p.join(5)
