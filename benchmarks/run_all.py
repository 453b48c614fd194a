"""Run every benchmark of the index, benchmarks/README.md (``make bench`` = ``python -m benchmarks.run_all --quick``).

Each benchmark runs as its own process (``python -m benchmarks.<name> [mode] [settings]``), one
after another, under one overall time budget (default 1500 s). ``--quick`` runs each with the
short settings listed in ``INDEX``; without it, each runs with its own defaults (the figures of
docs/PERF.md, and much longer). The benchmarks that need a GPU are left to ``make gpu-check``;
those that need llama.cpp run only when its ``llama-server`` is already built (building it takes
~12 minutes: ``python -m benchmarks.llamacpp_build``), and are skipped with a note otherwise. The
exit status is non-zero if a benchmark that ran failed or the budget ran out.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
CPU, LLAMA_CPP, GPU = "CPU", "llama.cpp", "GPU"


@dataclass(frozen=True)
class Bench:
    module: str  # python -m benchmarks.<module>
    quick: tuple[str, ...] = ()  # the arguments of its quick run
    needs: str = CPU
    full: tuple[str, ...] = ()  # the arguments of its full run (a mode or phases; else its defaults)
    part: str = ""  # which mode or phases, where the index lists a benchmark's parts apart

    @property
    def label(self) -> str:
        return f"{self.module} {self.part}".strip()


# One entry per benchmark (and mode) of the index, in its order.
INDEX = (
    Bench("paper_sim", ("--quick",)),
    Bench("sharing_savings", ("--quick",)),
    Bench("scheduler_overhead", ("--repeats", "2", "--steps", "32")),
    Bench("preemption_recompute"),
    Bench("wire_codec", ("--rounds", "3", "--reps", "500")),
    Bench("step_overlap", ("--quick",)),
    Bench("step_overlap", ("--quick", "--structured"), full=("--structured",), part="--structured"),
    Bench("executor_scaling", ("--quick",)),
    Bench("speculative", ("--quick",)),
    Bench("batch_invariance", ("--quick",)),
    Bench("tier_capacity", ("--quick", "--phases", "cost,busy,delay,intervals"),
          full=("--phases", "cost,busy,delay,intervals")),
    Bench("tier_capacity", ("--quick", "--phases", "apis"), full=("--phases", "apis"), part="apis"),
    Bench("front_burst_memory", ("--calls", "20")),
    Bench("stack_ceiling", ("--streams", "1,64", "--repeats", "1", "--tokens", "32")),
    Bench("hostile_load", ("--quick",)),
    Bench("executor_cpu", ("--batch-sizes", "1,16", "--decode-steps", "8", "--profile-steps", "2")),
    Bench("executor_cpu", ("attention", "--seqs", "16"), full=("attention",), part="attention"),
    Bench("executor_cpu", ("roofline", "--batch-sizes", "1,16", "--steps", "8", "--repeats", "1"),
          full=("roofline",), part="roofline"),
    Bench("prefill_decode_cpu", ("--batch-sizes", "1,4", "--repeats", "1")),
    Bench("lora_delta_cpu", ("--reps", "30")),
    Bench("lora", ("--quick",)),
    Bench("lora_decode_cpu", ("--reps", "3")),
    Bench("cpu_agreement", ("--prompts", "4", "--steps", "20")),
    Bench("cpu_agreement", ("--gguf", "--formats", "q4_1,int8", "--prompts", "2", "--steps", "10"), full=("--gguf",),
          part="--gguf"),
    Bench("serve_vs_hf", ("--quick",)),
    Bench("tensor_parallel", ("--quick",)),
    Bench("cpu_vs_llamacpp", ("--formats", "bf16", "--concurrency", "1,16", "--reps", "1"), needs=LLAMA_CPP),
    Bench("cpu_vs_llamacpp", ("--gguf", "--formats", "q4_1", "--concurrency", "1,16", "--reps", "1"), needs=LLAMA_CPP,
          full=("--gguf",), part="--gguf"),
    Bench("device_idle", needs=GPU),
    Bench("kernels.gpu_check", needs=GPU),
)


def command(bench: Bench, quick: bool) -> list[str]:
    return [sys.executable, "-m", f"benchmarks.{bench.module}", *(bench.quick if quick else bench.full)]


def unavailable(bench: Bench) -> str | None:
    """Why ``bench`` cannot run here, or None."""
    if bench.needs == GPU:
        return "needs a GPU: make gpu-check"
    if bench.needs == LLAMA_CPP:
        from benchmarks.llamacpp_build import built_server

        if built_server() is None:
            return "needs llama.cpp's llama-server, not built here (python -m benchmarks.llamacpp_build)"
    return None


def run(names: list[str], quick: bool, budget_s: float) -> int:
    deadline = time.monotonic() + budget_s
    failures: list[str] = []
    summary: list[str] = []
    for bench in INDEX:
        if names and bench.module not in names:
            continue
        if (why := unavailable(bench)) is not None:
            summary.append(f"{bench.label:26s} skipped ({why})")
            continue
        left = deadline - time.monotonic()
        if left <= 5:
            failures.append(f"{bench.label}: no time left in the {budget_s:.0f} s budget")
            summary.append(f"{bench.label:26s} not run (budget spent)")
            continue
        cmd = command(bench, quick)
        print(f"\n=== {' '.join(cmd[1:])} (time left {left:.0f} s) ===", flush=True)
        t0 = time.monotonic()
        try:
            rc: int | str = subprocess.run(cmd, cwd=BENCH_DIR.parent, timeout=left).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        wall = time.monotonic() - t0
        summary.append(f"{bench.label:26s} {'ok' if rc == 0 else f'FAILED ({rc})':12s} {wall:6.1f} s")
        if rc != 0:
            failures.append(f"{bench.label}: {rc}")
    print("\n=== summary ===\n" + "\n".join(summary), flush=True)
    if failures:
        print("failures: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the short versions (make bench)")
    ap.add_argument("--budget-s", type=float, default=1500.0, help="overall time budget in seconds")
    ap.add_argument("--only", nargs="*", default=[], help="run only these benchmark modules")
    ap.add_argument("--list", action="store_true",
                    help="print the index as JSON (label, needs, quick command, why skipped here); run nothing")
    args = ap.parse_args(argv)
    if args.list:
        print(json.dumps([{"label": b.label, "module": b.module, "needs": b.needs, "quick": command(b, True)[2:],
                           "skipped": unavailable(b)} for b in INDEX]))
        return 0
    return run(args.only, args.quick, args.budget_s)


if __name__ == "__main__":
    raise SystemExit(main())
