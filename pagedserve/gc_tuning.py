"""Garbage-collector settings for a serving process: the scheduler, its fronts and engine cores, each
executor (after its warm-up), and the benchmarks that stand in for them."""

from __future__ import annotations

import gc


def tune_gc() -> None:
    """Collector settings for the serving process (call once, after start-up).

    Each step allocates a few small objects per token (updates, deltas, futures);
    with the default gen-0 threshold of 700 allocations the collector runs many
    times per step and its older generations walk every live sequence. Freezing
    what start-up allocated and collecting gen 0 every 20k allocations cut the
    engine's CPU per 256-sequence step from 6.9 to 5.4 ms (benchmarks/
    executor_scaling.py, 4 executors, same run); cycles are still collected.
    In an executor, torch and the model leave ~210K tracked objects: one full
    collection of them took 96 ms, a pause of the compute thread whenever the
    allocations of steps set one off (the first requests after start-up).
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(100000, 20, 100)
