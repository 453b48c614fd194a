"""The engine with in-process executors: the real ZeroMQ worker around the fake executor.

Shared by the engine tests (tests/unit/engine/test_engine.py, tests/unit/engine/test_failure_kinds.py). The runner
keeps the executor's side of the result contract (``StepResult``): a refused plan refuses the
plans after it until a reset, and sequences a step failed are dropped and skipped in the plans
behind it (the real ``DroppedSeqs``). Faults are injected through ``FakeRunner.fault``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable

from tokenizers import Tokenizer

from executor_svc.dropped import DroppedSeqs
from executor_svc.worker import ExecutorWorker
from pagedserve import wire
from pagedserve.engine_api import FinishReason, GenerationRequest, RequestParams
from pagedserve.wire import SamplingParams
from scheduler_svc.engine.engine_config import EngineConfig
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing.fake_executor import FakeExecutor
from testing.in_process_engine import Engine

BLOCKS = 64

# A fault sees each plan (after the dropped sequences are skipped) and the result the fake executor
# produced for it (None before it runs); it returns the result to send instead, or None.
Fault = Callable[[wire.BatchPlan, "wire.StepResult | None", "FakeRunner"], "wire.StepResult | None"]


class FakeRunner:
    """The worker's runner interface over the fake executor (``step_s``: a slow device)."""

    def __init__(self, vocab: int, step_s: float = 0.0, fault: Fault | None = None) -> None:
        self.vocab, self.step_s, self.fault = vocab, step_s, fault
        self.resets = 0
        self.reset()
        self.resets = 0

    def reset(self) -> None:
        """Forget every sequence; the KV cache's content stays, as a device's does (the scheduler's
        prefix cache may still point at it)."""
        if not hasattr(self, "fake"):
            self.fake = FakeExecutor(BLOCKS, 16, 16, vocab_size=self.vocab)
        self.fake.seqs.clear()
        self.dropped = DroppedSeqs()
        self.refusing = False
        self.resets += 1

    def execute(self, plan: wire.BatchPlan) -> wire.StepResult:
        time.sleep(self.step_s)
        if self.refusing:
            return wire.StepResult(plan.step_id, refused=True, error="discarded: a plan before it was refused")
        plan = self.dropped.skip(plan)
        if self.fault is not None and (res := self.fault(plan, None, self)) is not None:
            self.refusing = res.refused
            return res
        res = self.fake.run(plan)
        if self.fault is not None and (changed := self.fault(plan, res, self)) is not None:
            return changed
        return res

    def fail_seqs(self, res: wire.StepResult, seq_ids: list[int], rejected: str | None = None) -> wire.StepResult:
        """``res`` as if the step could not serve ``seq_ids``: dropped, reported failed; ``rejected``:
        and each rejected for its request's own grammar, with this reason."""
        for sid in seq_ids:
            self.fake.seqs.pop(sid, None)
        self.dropped.add(seq_ids)
        kept = [(s, t) for s, t in zip(res.sampled_seq_ids, res.sampled_token_ids, strict=True) if s not in seq_ids]
        return wire.StepResult(res.step_id, [s for s, _ in kept], [t for _, t in kept],
                               [x for x in res.logprobs if x.seq_id not in seq_ids],
                               [x for x in res.beam_candidates if x.seq_id not in seq_ids],
                               failed_seq_ids=list(seq_ids), error="injected device error",
                               rejected=[] if rejected is None else [wire.SeqRejection(s, rejected) for s in seq_ids])


class FakeExecutorThread:
    def __init__(self, endpoint: str, name: str, vocab: int, step_s: float = 0.0,
                 drain_timeout: float = 5.0, fault: Fault | None = None, max_model_len: int = 1024) -> None:
        hs = wire.Handshake(name, wire.WIRE_VERSION, "fake", "fake-model", "FakeForCausalLM", vocab, 16,
                            BLOCKS, 16, max_model_len, "float32", "cpu")
        self.runner = FakeRunner(vocab, step_s, fault)
        self.worker = ExecutorWorker(endpoint, self.runner, hs, drain_timeout=drain_timeout)
        self.thread = threading.Thread(target=self.worker.run, daemon=True)
        self.thread.start()

    def kill(self) -> None:
        self.worker._signals = 2  # exits at once, without a drain: a crash as the scheduler sees it
        self.thread.join(5)


def req(rid: str, prompt: list[int], max_tokens: int = 8, **kw) -> GenerationRequest:
    return GenerationRequest(rid, prompt, RequestParams(max_tokens=max_tokens,
                                                        sampling=SamplingParams(temperature=0.0),
                                                        ignore_eos=True, **kw))


@contextlib.asynccontextmanager
async def running(tokenizer: Tokenizer, n_executors: int, metrics=None, **cfg_kw):
    """An engine with ``n_executors`` fake executors registered; everything stopped after."""
    scheduler = cfg_kw.pop("scheduler", None) or SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=256)
    cfg = EngineConfig(scheduler=scheduler, executor_endpoint="tcp://127.0.0.1:0", heartbeat_interval_s=0.2,
                       **cfg_kw)
    engine = Engine(cfg, tokenizer, eos_token_ids=(), metrics=metrics)
    await engine.start()
    execs = [engine_executor(engine, f"fake{i}") for i in range(n_executors)]
    try:
        while len(engine.slots) < n_executors:
            await asyncio.sleep(0.01)
        yield engine, execs
    finally:
        await engine.shutdown(0)
        for e in execs:
            e.kill()


def engine_executor(engine: Engine, name: str, step_s: float = 0.0, drain_timeout: float = 5.0,
                    fault: Fault | None = None, max_model_len: int = 1024) -> FakeExecutorThread:
    return FakeExecutorThread(f"tcp://127.0.0.1:{engine.hub.bound_port}", name,
                              engine.tokenizer.get_vocab_size(), step_s, drain_timeout, fault, max_model_len)


async def collect(engine: Engine, r: GenerationRequest):
    tokens: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    finish: dict[int, FinishReason] = {}
    usage = None
    async for out in engine.generate(r):
        for c in out.choices:
            tokens.setdefault(c.index, []).extend(c.token_ids)
            text[c.index] = text.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        usage = out.usage or usage
    return tokens, text, finish, usage


async def settle(engine: Engine) -> None:
    """Wait until every scheduler is idle, then check it holds nothing."""
    for _ in range(200):
        if all(not s.scheduler.has_work() for s in engine.slots.values()):
            break
        await asyncio.sleep(0.02)
    for slot in engine.slots.values():
        slot.scheduler.check_integrity()
        assert slot.scheduler.block_stats()["used"] == 0
        assert not slot.scheduler.has_work()


def run(coro, timeout: float = 60):
    return asyncio.run(asyncio.wait_for(coro, timeout))
