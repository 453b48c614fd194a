"""Encode + decode cost of the scheduler <-> executor messages, and their size.

Times a 256-sequence decode plan (what the scheduler sends every step once
prompts are in: ids and one new token each) and a 256-sequence step result
(one sampled token each), as encode followed by decode, best of several
rounds of many repetitions. ``--baseline REV`` loads the wire package of an
earlier commit (``pagedserve/wire/`` from ``git show``, under a private name)
into this process and times it side by side, alternating rounds.

    .venv/bin/python -m benchmarks.wire_codec [--baseline e02d98d~] [--rounds 7]

Prints a table, then one JSON line: ``plan_us_256``, ``result_us_256``,
``bytes_per_seq_step_256`` (plan bytes per sequence), and ``baseline_*`` keys.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

N = 256


def _load_baseline(rev: str) -> ModuleType:
    """The wire package of ``rev``, loaded from git as the private package ``_baseline_wire``."""
    tmp = Path(tempfile.mkdtemp(prefix="wire-baseline-")) / "_baseline_wire"
    tmp.mkdir()
    names = subprocess.run(["git", "ls-tree", "--name-only", f"{rev}:pagedserve/wire"], check=True,
                           capture_output=True, text=True).stdout.split()
    for name in (n for n in names if n.endswith(".py")):
        src = subprocess.run(["git", "show", f"{rev}:pagedserve/wire/{name}"], check=True,
                             capture_output=True, text=True).stdout
        (tmp / name).write_text(src.replace("pagedserve.wire", "_baseline_wire"))
    sys.path.insert(0, str(tmp.parent))
    try:
        return importlib.import_module("_baseline_wire")
    finally:
        sys.path.pop(0)


def _messages(mod) -> tuple:
    ids = list(range(1000, 1000 + N))
    plan = mod.BatchPlan(7, ids, [1] * N)
    result = mod.StepResult(7, list(ids), [(i * 7919) % 50000 for i in range(N)])
    return plan, result


def _time(mod, msg, reps: int) -> float:
    """Microseconds per encode + decode."""
    enc, dec = mod.encode, mod.decode
    t = time.perf_counter()
    for _ in range(reps):
        dec(enc(msg))
    return (time.perf_counter() - t) / reps * 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", help="git revision whose pagedserve/wire codec to compare with")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--reps", type=int, default=2000)
    a = ap.parse_args(argv)
    from pagedserve import wire

    codecs = {"msgspec (pagedserve.wire)": wire}
    if a.baseline:
        codecs[f"baseline ({a.baseline})"] = _load_baseline(a.baseline)
    times: dict[str, dict[str, list[float]]] = {k: {"plan": [], "result": []} for k in codecs}
    for _ in range(a.rounds):  # alternate codecs within each round: same machine state for both
        for name, mod in codecs.items():
            plan, result = _messages(mod)
            times[name]["plan"].append(_time(mod, plan, a.reps))
            times[name]["result"].append(_time(mod, result, a.reps))
    out: dict[str, float] = {}
    print(f"{'codec':<32} {'plan 256 (us)':>14} {'result 256 (us)':>16} {'plan bytes/seq':>15}")
    for i, (name, mod) in enumerate(codecs.items()):
        plan, _ = _messages(mod)
        p, r = statistics.median(times[name]["plan"]), statistics.median(times[name]["result"])
        size = len(mod.encode(plan)) / N
        print(f"{name:<32} {p:>14.1f} {r:>16.1f} {size:>15.2f}")
        prefix = "" if i == 0 else "baseline_"
        out.update({f"{prefix}plan_us_256": round(p, 2), f"{prefix}result_us_256": round(r, 2),
                    f"{prefix}bytes_per_seq_step_256": round(size, 2)})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
