"""Paper Fig. 15: KV blocks saved by sharing, for parallel sampling and beam search.

saving = 1 - (physical blocks held) / (blocks the same sequences would need
without sharing, i.e. the sum of their block-table lengths), both summed over
the run weighted by step time (a time average).

Measured through the real :class:`Scheduler` (paged KV manager, sharing by
fork + copy-on-write, beam search with pruned beams freed) driven by
:class:`SimExecutor` in virtual time, on Alpaca-like and ShareGPT-like
traces with EOS ignored (every choice / beam runs to the trace's output
length). The load is kept low so that no request is preempted (a recomputed
request would lose its sharing and muddy the measure); preemptions are
reported. The block-level model of ``testing/sim/sharing_model.py`` is run on the same
lengths as a cross-check. The simulated executor's beam candidates have random
log-probs, so which beams survive is random, not a language model's choice.

Usage::

    python -m benchmarks.sharing_savings --quick
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from testing.sim.sharing_model import measure

WIDTHS = (2, 4, 6)
PAPER = {("alpaca", "parallel"): "6.1-9.8%", ("alpaca", "beam"): "37.6-55.2%",
         ("sharegpt", "parallel"): "16.2-30.5%", ("sharegpt", "beam"): "44.3-66.3%"}
# the paper's range ends, read as its n (or width) = 2 and = 6 bars
PAPER_ENDS = {k: tuple(float(x) for x in v.rstrip("%").split("-")) for k, v in PAPER.items()}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(9, 3.2))
    for ax, wl in zip(axes, ("alpaca", "sharegpt"), strict=True):
        for j, mode in enumerate(("parallel", "beam")):
            rs = [r for r in rows if r["workload"] == wl and r["mode"] == mode]
            xs = [j * (len(WIDTHS) + 1) + i for i in range(len(rs))]
            bars = ax.bar(xs, [100 * r["saving"] for r in rs], color="#1565c0" if mode == "parallel" else "#2e7d32")
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
            lo, hi = PAPER_ENDS[(wl, mode)]
            ax.scatter([xs[0], xs[-1]], [lo, hi], marker="x", color="k", zorder=3,
                       label="paper (n, w = 2 and 6)" if j == 0 else None)
            for x, r in zip(xs, rs, strict=True):
                ax.text(x, -6, f"{'n' if mode == 'parallel' else 'w'}={r['width']}", ha="center", fontsize=7)
        ax.set_xticks([1, len(WIDTHS) + 2], ["parallel sampling", "beam search"])
        ax.tick_params(axis="x", pad=14)
        ax.set_ylabel("memory saving (%)")
        ax.set_title(f"{wl}-like (simulated OPT-13B)", fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def markdown(rows: list[dict], wall: float, mode: str) -> str:
    lines = [f"### Sharing savings, paper Fig. 15 ({mode} mode, {wall:.0f} s wall)", "",
             "| workload | decoding | n / width | saving (scheduler) | saving (block model) | preemptions "
             "| paper (n or width = 2..6) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {r['mode']} | {r['width']} | {100 * r['saving']:.1f}% | "
                     f"{100 * r['model_saving']:.1f}% | {r['preemptions']} | {PAPER[(r['workload'], r['mode'])]} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer requests per trace")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fig-dir", default=None,
                    help="where figures and tables go (default: build/bench with --quick, else docs/figures)")
    args = ap.parse_args(argv)
    nums = {"alpaca": 120, "sharegpt": 40} if args.quick else {"alpaca": 600, "sharegpt": 200}
    t0 = time.perf_counter()
    rows = [measure(wl, mode, w, nums[wl], args.seed)
            for wl in ("alpaca", "sharegpt") for mode in ("parallel", "beam") for w in WIDTHS]
    wall = time.perf_counter() - t0
    fig_dir = Path(args.fig_dir or ("build/bench" if args.quick else "docs/figures"))
    fig_dir.mkdir(parents=True, exist_ok=True)
    plot(rows, fig_dir / "fig15_sharing.png")
    md = markdown(rows, wall, "quick" if args.quick else "full")
    (fig_dir / "sharing_savings.md").write_text(md)
    (fig_dir / "sharing_savings.json").write_text(json.dumps(rows, indent=1))
    print(md)
    print(json.dumps({f"saving_{r['workload']}_{r['mode']}_{r['width']}": round(r["saving"], 4) for r in rows}
                     | {f"model_saving_{r['workload']}_{r['mode']}_{r['width']}": round(r["model_saving"], 4)
                        for r in rows} | {"preemptions": sum(r["preemptions"] for r in rows)}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
