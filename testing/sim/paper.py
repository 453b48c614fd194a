"""The paper-scale simulation's runs and what is read off them: many traces through the real
scheduler at once (:func:`run_jobs`), the output-tail sensitivity of Fig. 13's point, and the
sustained rate of a latency curve. ``benchmarks/paper_sim.py`` is their command line."""

from __future__ import annotations

import dataclasses
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict

import numpy as np

from pagedserve.bench.workloads import SHAREGPT, synthetic_trace
from testing.sim.runs import RunStats, run_trace

# (workload, rate) of paper Fig. 13 (OPT-13B): ShareGPT at 2 req/s, Alpaca at 30 req/s.
FIG13_POINTS = (("sharegpt", 2.0), ("alpaca", 30.0))


def _one(job: tuple[str, str, float, int, int]) -> RunStats:
    allocator, workload, rate, num, seed = job
    return run_trace(allocator, synthetic_trace(workload, num, rate, seed=seed), workload, rate, seed=seed)


def run_jobs(jobs: list[tuple[str, str, float, int, int]], workers: int) -> list[RunStats]:
    if workers <= 1:
        return [_one(j) for j in jobs]
    with ProcessPoolExecutor(max_workers=workers) as pool:
        return list(pool.map(_one, jobs))


def _tail_trace(sigma: float, num: int, seed: int):
    return synthetic_trace(dataclasses.replace(SHAREGPT, output_sigma=sigma), num, FIG13_POINTS[0][1], seed=seed)


def _tail_one(job: tuple[str, float, int, int]) -> RunStats:
    allocator, sigma, num, seed = job
    return run_trace(allocator, _tail_trace(sigma, num, seed), f"sharegpt-sigma{sigma:g}", FIG13_POINTS[0][1],
                     seed=seed)


def tail_sensitivity(cfg: dict, workers: int, seed: int) -> list[dict]:
    """Fig. 13's ShareGPT point (paged vs Orca Oracle) for several output-length tails.

    Only the log-normal sigma of the output length changes; its mu is re-solved so the
    mean stays the paper's 338 tokens.
    """
    sigmas, num = cfg["tail"]["sigmas"], cfg["tail"]["requests"]
    jobs = [(a, sg, num, seed) for sg in sigmas for a in ("paged", "orca-oracle")]
    if workers <= 1:
        stats = [_tail_one(j) for j in jobs]
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            stats = list(pool.map(_tail_one, jobs))
    rows = []
    for i, sg in enumerate(sigmas):
        out = np.array([t.output_len for t in _tail_trace(sg, num, seed)])
        rows.append({"sigma": sg, "output_mean": float(out.mean()), "output_p50": float(np.median(out)),
                     "output_p90": float(np.percentile(out, 90)),
                     "paged": asdict(stats[2 * i]), "orca-oracle": asdict(stats[2 * i + 1])})
    return rows


def sustained_rate(rates: list[float], lats: list[float], threshold: float) -> tuple[float, bool]:
    """Rate where normalized latency crosses ``threshold`` (linear interpolation).

    Returns (rate, exact): ``exact`` is False when the curve never crosses
    within the sweep (then the rate is the highest measured, a lower bound) or
    is already above at the lowest rate (then 0.0).
    """
    for i, (r, lat) in enumerate(zip(rates, lats, strict=True)):
        if lat > threshold:
            if i == 0:
                return 0.0, False
            r0, l0 = rates[i - 1], lats[i - 1]
            return r0 + (r - r0) * (threshold - l0) / (lat - l0), True
    return rates[-1], False
