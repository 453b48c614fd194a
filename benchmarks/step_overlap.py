"""Does the executor ever wait for the scheduler? Busy fraction with the overlapped and the sequential loop.

The real engine (scheduler, router, front streams, detokenization, metrics) runs in
this process with one consumer per request iterating ``Engine.generate``, as
the gRPC handlers do. Each executor is a real ``ExecutorWorker`` process
(ZeroMQ, handshake, heartbeats) whose runner applies the plan deltas
(benchmarks/sim_executor.py) and then sleeps to a constant modelled step time,
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
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import time

import uvloop

from benchmarks.engine_harness import consume, distinct_requests, engine_with_executors, small_tokenizer
from scheduler_svc.gc_tuning import tune_gc
from scheduler_svc.metrics import Metrics
from scheduler_svc.sched_config import EngineConfig, SchedulerConfig

SEQS, PROMPT = 256, 64
CONFIGS = (("5ms_256", 1, 0.005), ("10ms_4x256", 4, 0.010), ("20ms_8x256", 8, 0.020))


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one repetition, 64 output tokens")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", help="run one configuration, e.g. 5ms_256")
    a = ap.parse_args(argv)
    output_len, repeats = (64, 1) if a.quick else (128, a.repeats)
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
