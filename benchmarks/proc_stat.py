"""CPU time of processes and of the machine, from the operating system (Linux ``/proc``).

A process's CPU is ``utime + stime`` of ``/proc/<pid>/stat``: every thread of it, the ones that
have exited included, in clock ticks (10 ms on Linux), so a window should hold seconds of CPU.
The machine's share of busy time (and the part stolen by the hypervisor) comes from ``/proc/stat``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads)."""
    # The command name (field 2) may hold spaces and parentheses: the fields after its last ')'.
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime, stime (fields 14 and 15)


def thread_cpu_seconds(pid: int) -> dict[tuple[int, str], float]:
    """(thread id, thread name) -> user + system CPU seconds so far, for each live thread of ``pid``."""
    out: dict[tuple[int, str], float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            text = (task / "stat").read_text()
        except FileNotFoundError:  # (a thread that ended meanwhile)
            continue
        name = text[text.index("(") + 1:text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        out[(int(task.name), name)] = (int(fields[11]) + int(fields[12])) * TICK_S
    return out


def children(pid: int, module: str | None = None) -> list[int]:
    """The live child processes of ``pid`` (those running ``python -m module``, when given)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:  # (a thread that ended meanwhile)
            continue
    return sorted(c for c in set(out) if module is None or _runs(c, module))


def _runs(pid: int, module: str) -> bool:
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except FileNotFoundError:
        return False
    return b"-m" in argv and module.encode() in argv


@dataclass(frozen=True, slots=True)
class MachineTimes:
    """Cumulative ticks of all CPUs: busy (neither idle nor waiting for I/O), stolen, total."""

    busy: int
    steal: int
    total: int

    @staticmethod
    def now() -> MachineTimes:
        values = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        user, nice, system, idle, iowait, irq, softirq, steal = (values + [0] * 8)[:8]
        total = sum(values[:8])  # (guest time is already counted in user)
        return MachineTimes(total - idle - iowait - steal, steal, total)

    def cpus_since(self, before: MachineTimes) -> tuple[float, float]:
        """(CPUs busy, CPUs stolen) on average between ``before`` and this reading."""
        span = max(1, self.total - before.total)
        cpus = (os.cpu_count() or 1)
        return (cpus * (self.busy - before.busy) / span, cpus * (self.steal - before.steal) / span)
