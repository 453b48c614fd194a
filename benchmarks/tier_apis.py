"""``tier_capacity --phases apis``: the OpenAI-compatible HTTP front against the gRPC API on a real
model, same stack, same requests, side by side.

Starts one scheduler (``--http-port`` on, prefix caching off: every run sends the same prompts,
which a cache would serve faster the second time) and one CPU executor on ``--model``, then sends
the same fixed workload (default 64 requests, all at once, 64 streams in flight, prompts of 32-256
random tokens, outputs of 32-128, greedy, EOS ignored) through each front in turn with
``pagedserve-bench --api grpc`` and ``--api http``, each in its own client process, alternating
the order every repetition (``--repeats``) so load drift on a shared machine hits both alike.
Reports the median run of each front (pagedserve.bench.stats.compare_runs) and the CPU seconds the
scheduler and the client spent per run, which is where the fronts differ (the executor's work is
the same): the JSON keys ``comparison`` and ``cpu_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.serve_vs_hf import DEFAULT_MODEL, ServeProcesses, _children_cpu, _free_port, ensure_model
from pagedserve.bench.stats import compare_runs, format_comparison


def run_once(stack: ServeProcesses, http: str, api: str, args: argparse.Namespace) -> tuple[dict, dict]:
    """One pagedserve-bench run through ``api``: (its summary, CPU seconds of scheduler and client)."""
    cpu0, child0 = stack.cpu_seconds(), _children_cpu()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        subprocess.run([sys.executable, "-m", "pagedserve.bench.loadgen", "--api", api, "--server", stack.server,
                        "--http-server", http, "--workload", "fixed", "--num-requests", str(args.num_requests),
                        "--input-len", args.input_len, "--output-len", args.output_len, "--seed", str(args.seed),
                        "--rate", "inf", "--max-concurrency", str(args.concurrency), "--no-progress",
                        "--out", str(out)],
                       check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
        summary = json.loads(out.read_text())["summary"]
    if summary["failed"] or summary["short_outputs"]:
        raise RuntimeError(f"{api}: {summary['failed']} failed, {summary['short_outputs']} short; {summary['errors']}")
    cpu = {"scheduler": stack.cpu_seconds()["scheduler"] - cpu0["scheduler"],
           "client": _children_cpu() - child0}
    return summary, cpu


def add_args(ap: argparse.ArgumentParser) -> None:
    g = ap.add_argument_group("apis phase (a real model, HTTP against gRPC)")
    g.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    g.add_argument("--api-requests", dest="num_requests", type=int, default=64)
    g.add_argument("--api-concurrency", dest="concurrency", type=int, default=64, help="streams in flight")
    g.add_argument("--api-input-len", dest="input_len", default="32:256")
    g.add_argument("--api-output-len", dest="output_len", default="32:128")
    g.add_argument("--api-seed", dest="seed", type=int, default=0)
    g.add_argument("--api-threads", dest="threads", type=int, default=1, help="executor torch threads")
    g.add_argument("--api-kv-cache-memory", dest="kv_cache_memory", default="512MiB")
    g.add_argument("--api-out", dest="out", type=Path, default=None, help="also write every run here")


QUICK = {"num_requests": 16, "concurrency": 16, "output_len": "16:32"}


def measure(args: argparse.Namespace) -> dict:
    """The phase, ``args.repeats`` runs per front: {"comparison": ..., "cpu_s": ...}."""
    http_port = _free_port()
    stack = ServeProcesses(ensure_model(args.model), args.threads,
                           ["--http-port", str(http_port), "--max-num-seqs", "256"],
                           ["--kv-cache-memory", args.kv_cache_memory])
    http = f"127.0.0.1:{http_port}"
    runs: dict[str, list[dict]] = {"grpc": [], "http": []}
    cpu: dict[str, list[dict]] = {"grpc": [], "http": []}
    try:
        stack.wait_ready()
        for api in ("grpc", "http"):  # warm-up: first-call costs (imports, connections) out of the numbers
            run_once(stack, http, api, argparse.Namespace(**{**vars(args), "num_requests": 4}))
        for rep in range(args.repeats):
            for api in (("grpc", "http") if rep % 2 == 0 else ("http", "grpc")):
                summary, used = run_once(stack, http, api, args)
                runs[api].append(summary)
                cpu[api].append(used)
                print(f"rep {rep} {api}: {summary['output_throughput']:.1f} tok/s, TTFT p50 "
                      f"{summary['ttft_ms']['p50']:.0f} ms, scheduler {used['scheduler']:.2f} CPU-s, "
                      f"client {used['client']:.2f} CPU-s", flush=True)
    finally:
        stack.stop()
    comparison = compare_runs(runs)
    for api in runs:
        tokens = runs[api][0]["total_output_tokens"]
        for who in ("scheduler", "client"):
            comparison[api][f"{who}_cpu_ms_per_token"] = 1000 * statistics.median(c[who] for c in cpu[api]) / tokens
    print(format_comparison(comparison, f"HTTP vs gRPC: {args.num_requests} requests, {args.concurrency} streams"))
    for who in ("scheduler", "client"):
        print(f"{who} CPU per output token (ms, median): " + ", ".join(
            f"{api} {comparison[api][f'{who}_cpu_ms_per_token']:.3f}" for api in runs))
    report = {"comparison": comparison, "cpu_s": cpu}
    if args.out is not None:
        args.out.write_text(json.dumps({**report, "runs": runs}, indent=2) + "\n")
    return report
