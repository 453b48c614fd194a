"""Does the executor ever wait for the scheduler? Busy fraction with the overlapped and the sequential loop.

The real engine (scheduler, router, front streams, detokenization, metrics) runs in
this process with one consumer per request iterating ``Engine.generate``, as
the gRPC handlers do. Each executor is a real ``ExecutorWorker`` process
(ZeroMQ, handshake, heartbeats) whose runner applies the plan deltas
(testing/sim/executor.py) and then sleeps to a constant modelled step time,
so a step costs what a device step would while using almost no CPU. Every
executor gets 256 sequences (64-token prompts, 128 output tokens, greedy,
ignore_eos).

- executor busy = time inside ``execute`` / time from its first step's start to
  its last step's end, averaged over executors;
- scheduler CPU per step = this process's CPU time (engine, consumers, ZeroMQ
  I/O thread) / executor steps run.

Sync (``--no-async-scheduling``) and async runs alternate, each on a fresh
engine and executors; the median of ``--repeats`` is reported.

    .venv/bin/python -m benchmarks.step_overlap [--quick] [--repeats 3]

Prints a table, then one JSON line with ``busy_5ms_256``, ``busy_10ms_4x256``,
``busy_20ms_8x256``, ``sched_cpu_ms_per_step_256`` and the same keys with a
``sync_`` prefix.

``--structured``: structured outputs instead, on one executor with 5 ms steps and a 128K
vocabulary (testing/tokenizers.py). Unconstrained runs and runs with every one of the 256
sequences under a JSON schema (``STRUCTURED_SCHEMA``) alternate, on fresh engines; the simulated
executor samples only ids each sequence's grammar allows (benchmarks/grammar_sim.py, the
executor's own grammar code). The JSON line has ``busy_5ms_256`` and ``structured_busy_5ms_256``
(same run), the executor's grammar time per step (in the run, and alone: the simulated executor
and the scheduler in one process, nothing else running), the plan bytes per sequence per step with and
without the schema, and what the API edge's check of the schema costs once (cold) and again
(cached).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing as mp
import statistics
import time

import msgspec
import uvloop

from benchmarks.engine_harness import consume, distinct_requests, engine_with_executors
from pagedserve import wire
from pagedserve.engine_api import GenerationRequest
from pagedserve.gc_tuning import tune_gc
from scheduler_svc.engine.engine_config import EngineConfig
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from scheduler_svc.telemetry.metrics import Metrics
from testing.in_process_engine import Engine
from testing.tokenizers import small_tokenizer

SEQS, PROMPT = 256, 64
CONFIGS = (("5ms_256", 1, 0.005), ("10ms_4x256", 4, 0.010), ("20ms_8x256", 8, 0.020))
# Every sequence writes a long list of records (a bounded string, an integer with bounds, an enum, a
# boolean: what structured outputs are mostly asked for); 32 records outlast 128 tokens.
STRUCTURED_SCHEMA = {"type": "object", "required": ["rows"], "additionalProperties": False, "properties": {"rows": {
    "type": "array", "minItems": 32, "maxItems": 64, "items": {
        "type": "object", "required": ["id", "name", "kind", "ok"], "additionalProperties": False,
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                       "name": {"type": "string", "maxLength": 12}, "kind": {"enum": ["a", "b", "c"]},
                       "ok": {"type": "boolean"}}}}}}


async def run_once(n_exec: int, step_s: float, async_scheduling: bool, output_len: int, tok, eos) -> dict:
    cfg = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=SEQS, max_num_batched_tokens=8192),
                       executor_endpoint="tcp://127.0.0.1:0", max_queued_requests=10**6,
                       async_scheduling=async_scheduling)
    stats = [mp.get_context("spawn").Array("d", 4) for _ in range(n_exec)]
    async with engine_with_executors(cfg, tok, eos, n_exec, Metrics(), step_s, stats) as engine:
        reqs = distinct_requests(n_exec * SEQS, tok.get_vocab_size(), PROMPT, output_len)
        for st in stats:
            with st.get_lock():
                st[:] = [0.0, 0.0, 0.0, 0.0]
        steps0, cpu0, t0 = engine.num_steps, time.process_time(), time.perf_counter()
        tokens = sum(await asyncio.gather(*(consume(engine, r) for r in reqs)))
        wall, cpu, steps = time.perf_counter() - t0, time.process_time() - cpu0, engine.num_steps - steps0
    if tokens != len(reqs) * output_len:
        raise RuntimeError(f"{tokens} tokens streamed, expected {len(reqs) * output_len}")
    busy = [st[0] / (st[2] - st[1]) for st in stats if st[3] > 1]
    return {"busy": statistics.mean(busy), "cpu_ms_per_step": 1e3 * cpu / steps, "steps": steps,
            "tokens_per_s": tokens / wall, "gap_ms": 1e3 * (wall / (steps / n_exec) - step_s)}


SPEC = wire.Structured(wire.STRUCTURED_JSON, json.dumps(STRUCTURED_SCHEMA, separators=(",", ":")))


def _structured(req: GenerationRequest, eos: int) -> GenerationRequest:
    sp = msgspec.structs.replace(req.params.sampling, end_token_ids=[eos], structured=SPEC)
    return GenerationRequest(req.request_id, req.prompt_token_ids,
                             dataclasses.replace(req.params, sampling=sp, ignore_eos=False))


async def run_structured_once(constrained: bool, output_len: int, tok, eos: int, tokenizer_json: str) -> dict:
    """One engine, one GrammarSleepingRunner executor process with 5 ms steps, 256 sequences."""
    from benchmarks.grammar_sim import structured_executor_process

    cfg = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=SEQS, max_num_batched_tokens=8192),
                       executor_endpoint="tcp://127.0.0.1:0", max_queued_requests=10**6)
    ctx = mp.get_context("spawn")
    stats, grammar_s = ctx.Array("d", 4), ctx.Value("d", 0.0)
    engine = Engine(cfg, tok, (eos,), Metrics())
    await engine.start()
    proc = ctx.Process(target=structured_executor_process, daemon=True, args=(
        f"tcp://127.0.0.1:{engine.hub.bound_port}", "sim0", tok.get_vocab_size(), eos, 0.005, stats, tokenizer_json,
        grammar_s, SPEC))
    proc.start()
    try:
        while not any(s.conn.state == "ready" for s in engine.slots.values()):
            await asyncio.sleep(0.05)
        reqs = distinct_requests(SEQS, tok.get_vocab_size(), PROMPT, output_len)
        if constrained:
            reqs = [_structured(r, eos) for r in reqs]
        steps0, cpu0, t0 = engine.num_steps, time.process_time(), time.perf_counter()
        tokens = sum(await asyncio.gather(*(consume(engine, r) for r in reqs)))
        wall, cpu, steps = time.perf_counter() - t0, time.process_time() - cpu0, engine.num_steps - steps0
    finally:
        await engine.shutdown(0.0)
        proc.terminate()
        proc.join(5)
    # The device's share of the executor's time: 5 ms per step over the window from its first step's
    # start to its last one's end (what the executor did beyond the sleep, the grammar included, is idle
    # device time: a real executor fills the mask while its device computes, so only an overrun shows).
    return {"busy": stats[3] * 0.005 / (stats[2] - stats[1]), "cpu_ms_per_step": 1e3 * cpu / steps, "steps": steps,
            "tokens": tokens, "grammar_ms_per_step": 1e3 * grammar_s.value / stats[3],
            "gap_ms": 1e3 * (wall / steps - 0.005)}


def plan_bytes_per_seq_step(constrained: bool, output_len: int, vocab: int, eos: int) -> float:
    """The encoded plans of a whole run (256 sequences, ``output_len`` tokens each) per sequence per
    step: the spec travels once per residency (NewSeq), nothing per step."""
    from scheduler_svc.sched.scheduler import Scheduler
    from testing.sim.executor import SimExecutor

    sched = Scheduler(SchedulerConfig(max_num_seqs=SEQS, max_num_batched_tokens=8192, max_model_len=4096),
                      8192, 0, eos_token_ids=(eos,))
    sim = SimExecutor(eos_token_id=eos, vocab_size=vocab)
    for r in distinct_requests(SEQS, vocab, PROMPT, output_len):
        sched.add_request(_structured(r, eos) if constrained else r)
    total = seq_steps = 0
    while sched.has_work():
        plan = sched.schedule()
        if plan is None:
            continue
        total += len(wire.encode(plan))
        seq_steps += len(plan.scheduled_seq_ids)
        sched.update(sim.execute(plan))
    return total / seq_steps


def grammar_alone_ms(output_len: int, vocab: int, eos: int, tokenizer_json: str) -> float:
    """The executor's grammar time per 256-sequence step with nothing else running: the real scheduler
    and the grammar-masked simulated executor in this process, no engine, no sleeping."""
    from benchmarks.grammar_sim import GrammarSimExecutor
    from executor_svc.grammar import GrammarBackend
    from scheduler_svc.sched.scheduler import Scheduler

    backend = GrammarBackend(tokenizer_json, vocab, [eos])
    backend.compile(SPEC).result()
    sim = GrammarSimExecutor(eos_token_id=eos, vocab_size=vocab, backend=backend)
    sched = Scheduler(SchedulerConfig(max_num_seqs=SEQS, max_num_batched_tokens=8192, max_model_len=4096),
                      8192, 0, eos_token_ids=(eos,))
    for r in distinct_requests(SEQS, vocab, PROMPT, output_len):
        sched.add_request(_structured(r, eos))
    steps = 0
    while sched.has_work():
        plan = sched.schedule()
        if plan is not None:
            sched.update(sim.execute(plan))
            steps += 1
    return 1e3 * sim.grammar_seconds / steps


def edge_check_ms() -> tuple[float, float]:
    """The API edge's check of STRUCTURED_SCHEMA: the first time (llguidance), then cached."""
    from scheduler_svc.front.input.structured import CHECKER, StructuredFields, structured_spec

    CHECKER._verdicts.clear()
    times = []
    for _ in range(2):
        t = time.perf_counter()
        structured_spec(StructuredFields(json_schema=STRUCTURED_SCHEMA), 1 << 16)
        times.append(1e3 * (time.perf_counter() - t))
    return times[0], times[1]


def main_structured(repeats: int, output_len: int) -> None:
    import tempfile

    from testing.tokenizers import large_tokenizer, large_tokenizer_json

    tok = large_tokenizer()
    eos = tok.token_to_id("<|endoftext|>")
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        f.write(large_tokenizer_json())
    tune_gc()
    runs: dict[str, list[dict]] = {"plain": [], "json": []}
    print(f"{'sequences':<10} {'executor busy':>13} {'sched CPU ms/step':>18} {'grammar ms/step':>16} "
          f"{'tokens':>8}", flush=True)
    for _ in range(repeats):
        for mode in ("plain", "json"):
            r = uvloop.run(run_structured_once(mode == "json", output_len, tok, eos, f.name))
            runs[mode].append(r)
            print(f"{mode:<10} {r['busy']:>13.1%} {r['cpu_ms_per_step']:>18.2f} {r['grammar_ms_per_step']:>16.2f} "
                  f"{r['tokens']:>8}", flush=True)
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in runs.items()}
    cold, warm = edge_check_ms()
    alone = statistics.median(grammar_alone_ms(output_len, tok.get_vocab_size(), eos, f.name) for _ in range(3))
    summary = {
        "busy_5ms_256": round(med["plain"]["busy"], 4), "structured_busy_5ms_256": round(med["json"]["busy"], 4),
        "sched_cpu_ms_per_step_256": round(med["plain"]["cpu_ms_per_step"], 3),
        "structured_sched_cpu_ms_per_step_256": round(med["json"]["cpu_ms_per_step"], 3),
        "executor_grammar_ms_per_step_256": round(med["json"]["grammar_ms_per_step"], 3),
        "executor_grammar_ms_per_step_256_alone": round(alone, 3),
        "plan_bytes_per_seq_step": round(plan_bytes_per_seq_step(False, output_len, tok.get_vocab_size(), eos), 1),
        "structured_plan_bytes_per_seq_step": round(plan_bytes_per_seq_step(True, output_len, tok.get_vocab_size(),
                                                                            eos), 1),
        "bitmask_bytes_per_seq_step": (tok.get_vocab_size() + 31) // 32 * 4,
        "edge_check_ms_cold": round(cold, 2), "edge_check_ms_cached": round(warm, 4),
        "vocab": tok.get_vocab_size(), "repeats": repeats, "output_len": output_len, "seqs": SEQS,
        "busy_runs": [round(r["busy"], 3) for r in runs["plain"]],
        "structured_busy_runs": [round(r["busy"], 3) for r in runs["json"]],
    }
    print(json.dumps(summary))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one repetition, 64 output tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", help="run one configuration, e.g. 5ms_256")
    ap.add_argument("--structured", action="store_true",
                    help="5 ms steps, 128K vocabulary: unconstrained runs beside runs with every sequence under a "
                         "JSON schema")
    a = ap.parse_args(argv)
    output_len, repeats = (64, 1) if a.quick else (128, a.repeats)
    if a.structured:
        main_structured(repeats, output_len)
        return
    tok, eos = small_tokenizer()
    tune_gc()  # as the scheduler service does
    rows, summary = [], {}
    print(f"{'config':<12} {'loop':<6} {'executor busy':>13} {'sched CPU ms/step':>18} {'gap ms/step':>12} "
          f"{'tok/s':>9} {'runs (busy)':>20}", flush=True)
    for key, n_exec, step_s in CONFIGS:
        if a.only and a.only != key:
            continue
        runs: dict[str, list[dict]] = {"sync": [], "async": []}
        for _ in range(repeats):
            for mode in ("sync", "async"):
                # uvloop, as the scheduler service runs
                runs[mode].append(uvloop.run(run_once(n_exec, step_s, mode == "async", output_len, tok, eos)))
        for mode in ("sync", "async"):
            rs = runs[mode]
            med = {k: statistics.median(r[k] for r in rs) for k in ("busy", "cpu_ms_per_step", "gap_ms",
                                                                    "tokens_per_s")}
            prefix = "sync_" if mode == "sync" else ""
            summary[f"{prefix}busy_{key}"] = round(med["busy"], 4)
            if n_exec == 1:
                summary[f"{prefix}sched_cpu_ms_per_step_{SEQS}"] = round(med["cpu_ms_per_step"], 3)
            summary[f"{prefix}cpu_ms_per_step_{key}"] = round(med["cpu_ms_per_step"], 3)
            rows.append((key, mode, med, [round(r["busy"], 3) for r in rs]))
            print(f"{key:<12} {mode:<6} {med['busy']:>13.1%} {med['cpu_ms_per_step']:>18.2f} "
                  f"{med['gap_ms']:>12.2f} {med['tokens_per_s']:>9.0f} {str(rows[-1][3]):>20}", flush=True)
    summary.update({"repeats": repeats, "output_len": output_len, "seqs_per_executor": SEQS})
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
