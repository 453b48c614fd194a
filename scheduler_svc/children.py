"""The fronts a scheduler starts: ``--api-server-count`` processes sharing its public ports.

Each is ``python -m scheduler_svc.front_process`` with the scheduler's own command line (so it
gets the same flags and ``PAGEDSERVE_*`` variables) and, added, the engine core's local front link
and its own front id. The ports are fixed before they start (a port 0 becomes a free port, the
same for all), and each binds them with SO_REUSEPORT: the kernel spreads new connections among
the live fronts. A front that exits unasked is reported (its requests are aborted at the core at
once, not after its silence) and started again; the survivors keep serving the ports meanwhile.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler_svc.front_process import EXIT_WITH_PARENT

log = logging.getLogger(__name__)
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)  # after consecutive quick exits (one that ran 60 s resets it)


@dataclass(slots=True)
class FrontProcess:
    index: int
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    quick_exits: int = 0
    generation: int = 0

    @property
    def front_id(self) -> str:
        return f"local-{self.index}.{self.generation}"


@dataclass
class FrontProcesses:
    argv: list[str]  # the scheduler's own command line
    count: int
    core_endpoint: str
    on_exit: Callable[[str, str], None]  # (front id, why): the core aborts its requests now
    fronts: list[FrontProcess] = field(default_factory=list)
    stopping: bool = False

    def start(self) -> None:
        self.fronts = [FrontProcess(i) for i in range(self.count)]
        for f in self.fronts:
            self._spawn(f)

    def _spawn(self, f: FrontProcess) -> None:
        f.generation += 1
        env = dict(os.environ, **{EXIT_WITH_PARENT: "1"})
        f.proc = subprocess.Popen([sys.executable, "-m", "scheduler_svc.front_process", *self.argv,
                                   "--core", self.core_endpoint, "--front-id", f.front_id], env=env)
        f.started_at = time.monotonic()
        log.info("started front %s (pid %d)", f.front_id, f.proc.pid)

    async def watch(self) -> None:
        """Restart fronts that exit, until :meth:`stop` (polled: a child's exit is seen within 0.1 s)."""
        while not self.stopping:
            await asyncio.sleep(0.1)
            for f in self.fronts:
                if f.proc is None or f.proc.poll() is None or self.stopping:
                    continue
                why = f"exited with status {f.proc.returncode}"
                log.warning("front %s %s; starting it again", f.front_id, why)
                self.on_exit(f.front_id, why)
                ran = time.monotonic() - f.started_at
                f.quick_exits = 0 if ran > 60 else f.quick_exits + 1
                f.proc = None
                delay = RESTART_BACKOFF_S[min(f.quick_exits, len(RESTART_BACKOFF_S)) - 1] if f.quick_exits else 0.0
                asyncio.get_running_loop().call_later(delay, self._respawn, f)

    def _respawn(self, f: FrontProcess) -> None:
        if not self.stopping and f.proc is None:
            self._spawn(f)

    def signal_all(self, sig: int) -> None:
        for f in self.fronts:
            if f.proc is not None and f.proc.poll() is None:
                f.proc.send_signal(sig)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM every front (each drains its own requests), wait ``timeout_s``, then kill."""
        self.stopping = True
        self.signal_all(15)
        deadline = time.monotonic() + timeout_s
        while any(f.proc is not None and f.proc.poll() is None for f in self.fronts):
            if time.monotonic() > deadline:
                log.warning("fronts still running after %.0fs; killing them", timeout_s)
                self.signal_all(9)
                break
            await asyncio.sleep(0.05)

    def alive(self) -> int:
        return sum(1 for f in self.fronts if f.proc is not None and f.proc.poll() is None)


def fixed_port(host: str, port: int) -> int:
    """A port the fronts can all bind: ``port``, or a free one when it is 0."""
    if port:
        return port
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]
