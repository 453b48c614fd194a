"""Throughput with 1, 2, 4 and 8 executors: does the one scheduler keep up?

The real engine (scheduler, router, detokenization, output streams) runs in
this process and is driven through ``Engine.generate`` — the servicer's
interface, without gRPC clients, whose cost would belong to the clients.
Each executor is a real ``executor_svc.worker.ExecutorWorker`` process (real
ZeroMQ, handshake, heartbeats) whose runner is the simulated executor of
``testing/sim/executor.py``: it applies the plan deltas and sleeps for the
step time of the OPT-13B / A100 cost model, so a step costs what a GPU step
would while using almost no CPU.

    python -m benchmarks.executor_scaling [--quick] [--out results.json]

Scaling efficiency(N) = throughput(N) / (N * throughput(1)). The scheduler's
own CPU time per iteration is this process's CPU time divided by the number
of executor steps it planned (8 executors x 256 sequences in the last run).
Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path

from benchmarks.engine_harness import consume, distinct_requests, engine_with_executors
from pagedserve.gc_tuning import tune_gc
from scheduler_svc.engine.engine_config import EngineConfig
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing.tokenizers import small_tokenizer


async def run_once(num_executors: int, seqs_per_executor: int, prompt_len: int, output_len: int,
                   tok, eos: int | None) -> dict:
    cfg = EngineConfig(scheduler=SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192),
                       executor_endpoint="tcp://127.0.0.1:0", max_queued_requests=10**6)
    async with engine_with_executors(cfg, tok, eos, num_executors) as engine:
        reqs = distinct_requests(num_executors * seqs_per_executor, tok.get_vocab_size(), prompt_len, output_len)
        steps0 = engine.num_steps
        cpu0, t0 = time.process_time(), time.perf_counter()
        tokens = sum(await asyncio.gather(*(consume(engine, r) for r in reqs)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        steps = engine.num_steps - steps0
    assert tokens == len(reqs) * output_len, "every request must produce all its tokens"
    return {"executors": num_executors, "requests": len(reqs), "output_tokens": tokens,
            "seconds": wall, "tokens_per_s": tokens / wall, "scheduler_cpu_s": cpu, "steps": steps,
            "scheduler_cpu_ms_per_step": 1e3 * cpu / max(1, steps)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer tokens per request, one repetition")
    ap.add_argument("--executors", default="1,2,4,8")
    ap.add_argument("--seqs-per-executor", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    prompt_len, output_len = 64, 64 if a.quick else 128
    repeats = 1 if a.quick else a.repeats
    tok, eos = small_tokenizer()
    tune_gc()  # as the scheduler service does
    rows = []
    for n in (int(x) for x in a.executors.split(",")):
        runs = [asyncio.run(run_once(n, a.seqs_per_executor, prompt_len, output_len, tok, eos))
                for _ in range(repeats)]
        med = sorted(runs, key=lambda r: r["tokens_per_s"])[len(runs) // 2]
        med["tokens_per_s_runs"] = [round(r["tokens_per_s"], 1) for r in runs]
        rows.append(med)
    base = rows[0]["tokens_per_s"] / rows[0]["executors"]
    print(f"{'executors':>9} {'tok/s':>10} {'efficiency':>10} {'sched CPU ms/step':>18} {'steps':>7}")
    for r in rows:
        r["scaling_efficiency"] = r["tokens_per_s"] / (r["executors"] * base)
        print(f"{r['executors']:>9} {r['tokens_per_s']:>10.0f} {r['scaling_efficiency']:>10.1%} "
              f"{r['scheduler_cpu_ms_per_step']:>18.2f} {r['steps']:>7}")
    summary = {"rows": rows, "efficiency_at_max": rows[-1]["scaling_efficiency"],
               "scheduler_cpu_ms_per_step_at_max": rows[-1]["scheduler_cpu_ms_per_step"],
               "median_of": repeats, "prompt_len": prompt_len, "output_len": output_len,
               "seqs_per_executor": a.seqs_per_executor}
    if a.out:
        a.out.write_text(json.dumps(summary, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}))


if __name__ == "__main__":
    main()
