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

from benchmarks.sim_executor import CostModel, SimExecutor
from pagedserve import wire
from pagedserve.wire import SamplingParams
from scheduler_svc.api_types import GenerationRequest, RequestParams
from scheduler_svc.engine import Engine
from scheduler_svc.sched_config import EngineConfig

SIM_BLOCKS = 8192  # per executor: room for 256 sequences of 2k tokens, so no preemption


class SleepingRunner:
    """The worker's runner interface over SimExecutor, taking the step's time for real: the cost
    model's, or ``step_s``. ``stats`` (shared with the benchmark process), when given:
    [busy seconds, first step's start, last step's end, steps]."""

    def __init__(self, vocab: int, eos: int | None, step_s: float | None = None, stats=None) -> None:
        self.vocab, self.eos, self.step_s, self.stats = vocab, eos, step_s, stats
        self.reset()

    def reset(self) -> None:
        self.sim = SimExecutor(CostModel(), eos_token_id=self.eos, vocab_size=self.vocab)

    def execute(self, plan: wire.BatchPlan) -> wire.StepResult:
        start = time.perf_counter()
        result = self.sim.execute(plan)
        step_s = result.model_seconds if self.step_s is None else self.step_s
        time.sleep(max(0.0, step_s - (time.perf_counter() - start)))
        if (st := self.stats) is not None:
            end = time.perf_counter()
            with st.get_lock():
                st[0] += end - start
                st[1] = start if st[3] == 0 else st[1]
                st[2] = end
                st[3] += 1
        return result


def executor_process(endpoint: str, name: str, vocab: int, eos: int | None, step_s: float | None = None,
                     stats=None) -> None:
    """A real ExecutorWorker (ZeroMQ, handshake, heartbeats) around a SleepingRunner: a process target."""
    from executor_svc.worker import ExecutorWorker

    hs = wire.Handshake(executor_id=name, wire_version=wire.WIRE_VERSION, model_fingerprint="sim",
                        model_name="sim", architecture="SimExecutor", vocab_size=vocab, block_size=16,
                        num_device_blocks=SIM_BLOCKS, num_cpu_blocks=0, max_model_len=4096, dtype="float16",
                        device="sim")
    ExecutorWorker(endpoint, SleepingRunner(vocab, eos, step_s, stats), hs, drain_timeout=1.0).run()


def small_tokenizer():
    """The small tiny model's tokenizer and its EOS id."""
    from executor_svc.tiny_model import EOS_TOKEN, SIZES, train_tokenizer

    tok = train_tokenizer(SIZES["small"]["vocab"])
    return tok, tok.token_to_id(EOS_TOKEN)


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
