"""Where a batch-1 token's time and CPU go when served: one stream through the HTTP front, engine
core and a CPU executor, against the same decode step in process.

    .venv/bin/python -m benchmarks.batch1_cpu_split [--model models/tiny-llama] [--format bf16]
        [--threads 2] [--requests 8] [--reps 3]

* in process: ``ModelRunner`` decode steps at batch 1 (benchmarks/cpu_roofline.py's loop: 128-token
  prompt, 32 steps), the executor's own step with no transport;
* served: the stack of benchmarks/cpu_vs_llamacpp.py (scheduler with its front process, one
  executor with ``--cpu-threads``), ``--requests`` completions back to back from one client process
  (128 prompt token ids, 64 output tokens, greedy), time per output token after the first;
* CPU: each thread of every server process (``/proc/<pid>/task/*/stat``) and the client process,
  over the served run (the client's from its own process time around its requests), divided by the
  output tokens.

On a machine with as many CPUs as compute threads, the served step is the in-process step plus
what the other threads take from the compute threads, and more: a compute thread the OS preempts
stalls the others at the step's next barrier. Prints a table per repetition, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks.completions_client import run_in_subprocess
from benchmarks.cpu_roofline import time_steps
from benchmarks.cpu_vs_llamacpp import PagedServe
from benchmarks.proc_stat import children, thread_cpu_seconds

IN_PROCESS = {"f32": ("float32", {}), "bf16": ("bfloat16", {"dtype": "bfloat16"}),
              "int8": ("int8", {"quantization": "int8"})}
PROMPT, OUTPUT = 128, 64


def _processes(stack: PagedServe) -> dict[int, str]:
    """pid -> role: the scheduler (engine core 0), its front processes and other cores, the executor."""
    sched, executor = (p.pid for p in stack.procs)
    roles = {sched: "engine core 0", executor: "executor"}
    for pid in children(sched, "scheduler_svc.entrypoints.front"):
        roles[pid] = "front"
    for pid in children(sched, "scheduler_svc.entrypoints.core"):
        roles[pid] = "engine core"
    return roles


def _threads(roles: dict[int, str]) -> dict[tuple[str, int, str], float]:
    out = {}
    for pid, role in roles.items():
        for (tid, name), seconds in thread_cpu_seconds(pid).items():
            out[(role, tid, "main" if tid == pid else name)] = seconds
    return out


def served(args) -> dict:
    stack = PagedServe(Path(args.model), args.format, args.threads, args.kv_cache_memory)
    try:
        stack.wait_ready()
        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
        run_in_subprocess(stack.url, 1, 2, PROMPT, OUTPUT, vocab, 1)  # the first requests, not measured
        roles = _processes(stack)
        before = _threads(roles)
        result = run_in_subprocess(stack.url, 1, args.requests, PROMPT, OUTPUT, vocab, 2)
        after = _threads(roles)
    finally:
        stack.stop()
    tokens = sum(r.tokens for r in result.requests)
    per_token = {k: (after[k] - before.get(k, 0.0)) / tokens * 1e3 for k in after}
    return {"decode_ms": statistics.median((r.done - r.first_token) / (r.tokens - 1) for r in result.requests) * 1e3,
            "threads_ms": {f"{role} / {name} ({tid})": v for (role, tid, name), v in per_token.items() if v > 0},
            "client_ms": result.cpu_s / tokens * 1e3}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/tiny-llama")
    ap.add_argument("--format", choices=list(IN_PROCESS), default="bf16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--kv-cache-memory", default="64MiB")
    args = ap.parse_args(argv)

    import torch

    from executor_svc.model import load_model

    torch.set_num_threads(args.threads)
    fmt, load = IN_PROCESS[args.format]
    model = load_model(args.model, **{k: getattr(torch, v) if k == "dtype" else v for k, v in load.items()})
    runs = []
    for rep in range(args.reps):  # in process and served alternate, so both see the same machine
        step_ms = time_steps(model, fmt, 1, PROMPT, 32) * 1e3
        s = served(args)
        s["step_ms"] = step_ms
        runs.append(s)
        print(f"\nrep {rep}: in-process step {step_ms:.2f} ms, served {s['decode_ms']:.2f} ms per output token; "
              f"CPU per output token (ms):")
        for name, v in sorted(s["threads_ms"].items(), key=lambda kv: -kv[1]):
            if v >= 0.01:
                print(f"  {v:7.3f}  {name}")
        print(f"  {s['client_ms']:7.3f}  client process")
        time.sleep(1)
    roles: dict[str, list[float]] = {}
    for r in runs:
        sums: dict[str, float] = {}
        for name, v in r["threads_ms"].items():
            role = name.split(" / ")[0]
            sums[role] = sums.get(role, 0.0) + v
        sums["client"] = r["client_ms"]
        for role, v in sums.items():
            roles.setdefault(role, []).append(v)
    out = {"format": args.format, "threads": args.threads,
           "in_process_step_ms": round(statistics.median(r["step_ms"] for r in runs), 3),
           "served_decode_ms": round(statistics.median(r["decode_ms"] for r in runs), 3),
           "cpu_ms_per_token": {role: round(statistics.median(v), 3) for role, v in roles.items()}}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
