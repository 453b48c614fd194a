"""Run every benchmark (``make bench`` = ``python -m benchmarks.run_all --quick``).

Each benchmark runs as its own process (``python -m benchmarks.<name>``), one
after another, under one overall time budget (default 570 s, so that
``make bench`` stays under 10 minutes on 2 cores). Optional benchmarks owned by
other parts of the project run when their module exists and are skipped,
with a note, when it does not. ``--quick`` is passed on to the benchmarks that
accept it. The exit status is non-zero if any benchmark that ran failed or the
budget ran out.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

BENCH_DIR = Path(__file__).resolve().parent
# (module, required): every benchmark the docs cite; a missing one fails the run.
BENCHMARKS = (
    ("paper_sim", True),
    ("sharing_savings", True),
    ("scheduler_overhead", True),
    ("executor_cpu", True),
    ("executor_scaling", True),
    ("serve_vs_hf", True),
    ("tensor_parallel", True),
)


def _accepts_quick(module: str) -> bool:
    return "--quick" in (BENCH_DIR / f"{module}.py").read_text()


def run(names: list[str], quick: bool, budget_s: float) -> int:
    deadline = time.monotonic() + budget_s
    failures: list[str] = []
    summary: list[str] = []
    for module, required in BENCHMARKS:
        if names and module not in names:
            continue
        if not (BENCH_DIR / f"{module}.py").exists():
            if required:
                failures.append(f"{module}: missing")
            summary.append(f"{module:20s} skipped (not present)")
            continue
        left = deadline - time.monotonic()
        if left <= 5:
            failures.append(f"{module}: no time left in the {budget_s:.0f} s budget")
            summary.append(f"{module:20s} not run (budget spent)")
            continue
        cmd = [sys.executable, "-m", f"benchmarks.{module}"] + (["--quick"] if quick and _accepts_quick(module) else [])
        print(f"\n=== {' '.join(cmd[1:])} (time left {left:.0f} s) ===", flush=True)
        t0 = time.monotonic()
        try:
            rc = subprocess.run(cmd, cwd=BENCH_DIR.parent, timeout=left).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        wall = time.monotonic() - t0
        summary.append(f"{module:20s} {'ok' if rc == 0 else f'FAILED ({rc})':12s} {wall:6.1f} s")
        if rc != 0:
            failures.append(f"{module}: {rc}")
    print("\n=== summary ===\n" + "\n".join(summary), flush=True)
    if failures:
        print("failures: " + "; ".join(failures), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the short versions (make bench)")
    ap.add_argument("--budget-s", type=float, default=570.0, help="overall time budget in seconds")
    ap.add_argument("--only", nargs="*", default=[], help="run only these benchmark modules")
    args = ap.parse_args(argv)
    return run(args.only, args.quick, args.budget_s)


if __name__ == "__main__":
    raise SystemExit(main())
