"""How many of the compute threads a fused CPU decode step uses: all of them, or one fewer.

A decode step of a few sequences streams the weights and is over in a few milliseconds. When
the serving tier (engine core, fronts, clients) runs on the same CPUs, every one of its wakeups
preempts a compute thread, and the other threads wait for it at the step's next barrier: the
step takes about its own time plus all the CPU the serving path spends on it. One thread fewer
leaves that CPU to the serving path, which then runs beside the step, but the step reads the
weights with less bandwidth. Which is faster depends on the machine, the weight format, the batch
and what else runs there, so the executor measures it: per batch-size class it times the fused
steps with both counts, now and then, and keeps the faster (measured by a one-off benchmark since removed,
docs/PERF.md "Where a served batch-1 token goes"). A step's time is from its start to the next
fused step's start: the serving path's share lands in the step's Python work and in the OpenMP
threads' spinning after the call as much as in the call itself.

Both counts compute the same numbers: every output of a linear layer and every (sequence, KV
head) of attention is computed by one thread whatever the count (tests/unit/executor/test_step_threads.py).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque

log = logging.getLogger(__name__)

SAMPLES = 8  # wall times kept per (class, count): the median of these decides
FIRST_TRIAL_AFTER = 16  # steps of a class before its first trial of one thread fewer
TRIAL_EVERY = 256  # steps between trials; doubled while the choice holds, up to MAX_TRIAL_EVERY
MAX_TRIAL_EVERY = 4096
MARGIN = 0.03  # the other count must be this much faster to take over (noise does not flip the choice)


class _Class:
    __slots__ = ("best", "trying", "left", "until", "every", "times")

    def __init__(self, threads: int) -> None:
        self.best = threads
        self.trying: int | None = None  # the count under trial, for `left` more steps
        self.left = 0
        self.until = FIRST_TRIAL_AFTER  # steps until the next trial
        self.every = TRIAL_EVERY
        self.times = {threads: deque(maxlen=SAMPLES), threads - 1: deque(maxlen=SAMPLES)}


class StepThreads:
    """``pick`` before a fused decode step of ``n`` sequences, ``record`` the step's time once it is
    known (at the next fused step). ``threads`` is the most a step may use (torch's thread count);
    with 1 there is no choice."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._classes: dict[tuple[int, int], _Class] = {}

    @staticmethod
    def size_class(n: int) -> int:
        """1, 2, 3-4, 5-8, ... sequences; 65 and more are one class (compute-bound: all threads)."""
        return min(n - 1, 64).bit_length()

    def pick(self, n: int, threads: int) -> int:
        if not self.enabled or threads < 2 or n > 64:
            return threads
        c = self._classes.get((self.size_class(n), threads))
        if c is None:
            c = self._classes[(self.size_class(n), threads)] = _Class(threads)
        if c.trying is None:
            if c.until > 0:
                c.until -= 1
            else:  # a trial: the count not in use, then the one in use again, SAMPLES steps each
                c.trying, c.left = (threads - 1 if c.best == threads else threads), 2 * SAMPLES
        if c.trying is not None:
            return c.trying if c.left > SAMPLES else c.best
        return c.best

    def record(self, n: int, threads_max: int, used: int, seconds: float | None) -> None:
        """The time of a step ``pick`` chose ``used`` for; None: it has none worth comparing."""
        c = self._classes.get((self.size_class(n), threads_max))
        if c is None or not self.enabled:
            return
        if seconds is not None:
            c.times[used].append(seconds)
        if c.trying is None:
            return
        c.left -= 1
        if c.left > 0:
            return
        # Both counts were just timed back to back: keep the faster by the median of its samples.
        old, c.trying = c.best, None
        tried = [t for t in c.times if len(c.times[t]) >= SAMPLES // 2]
        if len(tried) == 2:
            medians = {t: statistics.median(c.times[t]) for t in tried}
            other = next(t for t in tried if t != old)
            if medians[other] < medians[old] * (1 - MARGIN):
                c.best = other
            if c.best != old:
                log.info("fused decode steps of %s sequences: %d of %d threads now (%.2f vs %.2f ms)",
                         self._class_name(n), c.best, threads_max, medians[c.best] * 1e3, medians[old] * 1e3)
        c.every = min(2 * c.every, MAX_TRIAL_EVERY) if c.best == old else TRIAL_EVERY
        c.until = c.every

    def _class_name(self, n: int) -> str:
        k = self.size_class(n)
        lo, hi = (1 << (k - 1)) + 1 if k else 1, 1 << k
        return str(hi) if lo == hi else f"{lo}-{hi}"

    def choices(self) -> dict[int, int]:
        """Size class -> the count in use (for logs and tests)."""
        return {k[0]: c.best for k, c in self._classes.items()}
