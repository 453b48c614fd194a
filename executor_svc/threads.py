"""How many threads a CPU executor computes with.

Order of precedence: ``--cpu-threads N`` (or ``PAGEDSERVE_CPU_THREADS``), then
``OMP_NUM_THREADS`` (the generic OpenMP knob; the tests set it to 1), then the CPUs this
process may use: its affinity mask (``taskset``, a Kubernetes static CPU policy) capped by
its cgroup's CPU quota (a Kubernetes CPU limit, ``docker --cpus``), rounded up. From 8 usable
CPUs up one is left to the executor's socket and heartbeat thread and the step's Python work;
below that every CPU computes (the socket thread wakes rarely and the OS schedules it between
the compute threads' waits).

The count goes to torch (``torch.set_num_threads``: its operators, and the C kernels, which
read it per call). It is read here only: ``executor_svc/__main__.py`` calls :func:`configure`.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import torch

log = logging.getLogger(__name__)

RESERVE_FROM = 8  # usable CPUs from which one is left to the socket/heartbeat thread
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _own_cgroup_dirs(root: Path) -> list[Path]:
    """This process's cgroup directory and its parents (v2; v1's cpu controller), deepest first."""
    text = _read(Path("/proc/self/cgroup")) or ""
    dirs: list[Path] = []
    for line in text.splitlines():
        _, controllers, rel = (line.split(":", 2) + ["", ""])[:3]
        base = root if controllers == "" else next(
            (root / c for c in ("cpu", "cpu,cpuacct", "cpuacct,cpu") if "cpu" in controllers.split(",")
             and (root / c).is_dir()), None)
        if base is None:
            continue
        d = base / rel.lstrip("/")
        while True:
            dirs.append(d)
            if d == base:
                break
            d = d.parent
    return dirs + [root]


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """The tightest CPU quota (in CPUs) of this process's cgroups, v2 ``cpu.max`` or v1
    ``cpu.cfs_quota_us``/``cpu.cfs_period_us``; None when there is none."""
    limits = []
    for d in _own_cgroup_dirs(root):
        v2 = _read(d / "cpu.max")
        if v2:
            quota, _, period = v2.partition(" ")
            if quota != "max" and period:
                limits.append(int(quota) / int(period))
            continue
        quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        if quota and period and int(quota) > 0:
            limits.append(int(quota) / int(period))
    return min(limits) if limits else None


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may run on: its affinity, capped by its cgroup quota (rounded up)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        n = min(n, max(1, math.ceil(limit)))
    return max(1, n)


def default_threads(root: Path = CGROUP_ROOT) -> int:
    n = usable_cpus(root)
    return n - 1 if n >= RESERVE_FROM else n


def resolve_threads(flag: int | None, environ: dict[str, str] | None = None,
                    root: Path = CGROUP_ROOT) -> tuple[int, str]:
    """(threads, where the number came from)."""
    environ = os.environ if environ is None else environ
    if flag is not None:
        return flag, "--cpu-threads"
    omp = environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if omp.isdigit() and int(omp) > 0:
        return int(omp), "OMP_NUM_THREADS"
    return default_threads(root), f"usable CPUs ({usable_cpus(root)})"


def configure(flag: int | None) -> int:
    """Set torch's (and so the kernels') thread count; returns it."""
    n, source = resolve_threads(flag)
    torch.set_num_threads(n)
    log.info("CPU compute threads: %d (from %s)", n, source)
    return n
