"""The processes a scheduler starts and keeps alive: its fronts, and its other engine cores.

Fronts (``--api-server-count``) are ``python -m scheduler_svc.entrypoints.front`` with the scheduler's
own command line (same flags, same ``PAGEDSERVE_*`` variables) and, added, every engine core's
local front link and a front id of their own. The public ports are claimed before they start
(each checked free of any other program, a port 0 made one free port, the same for all:
pagedserve/port_claim.py), and each front binds them with SO_REUSEPORT: the kernel spreads new
connections among the live fronts. Engine cores beyond the first
(``--engine-cores``) are ``python -m scheduler_svc.entrypoints.core``, likewise.

A child that exits unasked is reported at once (a front's requests are aborted at the core, not
after its silence) and started again, after a backoff when it keeps exiting quickly; the other
fronts keep serving the ports meanwhile. A child does not outlive the scheduler (Linux's parent
death signal).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)
RESTART_BACKOFF_S = (0.5, 1.0, 2.0, 5.0, 10.0)  # after consecutive quick exits (one that ran 60 s resets it)


@dataclass(slots=True)
class Child:
    index: int
    proc: subprocess.Popen | None = None
    started_at: float = 0.0
    quick_exits: int = 0
    generation: int = 0
    name: str = ""  # what it is called now (a front's id: its generation makes it new to the core)


@dataclass
class Children:
    module: str  # what each runs: python -m MODULE
    count: int
    args: Callable[[Child], list[str]]  # its command line (the scheduler's, and its own additions)
    name: Callable[[Child], str]
    on_exit: Callable[[str, str], None]  # (name, why)
    children: list[Child] = field(default_factory=list)
    stopping: bool = False

    def start(self) -> None:
        self.children = [Child(i) for i in range(self.count)]
        for c in self.children:
            self._spawn(c)

    def _spawn(self, c: Child) -> None:
        c.generation += 1
        c.name = self.name(c)
        env = dict(os.environ, **{EXIT_WITH_PARENT: "1"})
        c.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args(c)], env=env)
        c.started_at = time.monotonic()
        log.info("started %s (pid %d)", c.name, c.proc.pid)

    async def watch(self) -> None:
        """Start again what exits, until :meth:`stop` (polled: an exit is seen within 0.1 s)."""
        while not self.stopping:
            await asyncio.sleep(0.1)
            for c in self.children:
                if c.proc is None or c.proc.poll() is None or self.stopping:
                    continue
                why = f"exited with status {c.proc.returncode}"
                log.warning("%s %s; starting it again", c.name, why)
                c.quick_exits = 0 if time.monotonic() - c.started_at > 60 else c.quick_exits + 1
                c.proc = None
                try:
                    self.on_exit(c.name, why)
                except Exception:  # noqa: BLE001  a bug there must not stop this watch (nor the restart)
                    log.exception("handling the exit of %s failed", c.name)
                self._respawn_later(c)

    def _respawn_later(self, c: Child) -> None:
        delay = RESTART_BACKOFF_S[min(c.quick_exits, len(RESTART_BACKOFF_S)) - 1] if c.quick_exits else 0.0
        asyncio.get_running_loop().call_later(delay, self._respawn, c)

    def _respawn(self, c: Child) -> None:
        if self.stopping or c.proc is not None:
            return
        try:
            self._spawn(c)
        except OSError as exc:  # (out of processes or memory for a moment): try again, not never
            c.quick_exits += 1
            log.error("could not start %s again (%s); trying again", c.name, exc)
            self._respawn_later(c)

    def signal_all(self, sig: int) -> None:
        for c in self.children:
            if c.proc is not None and c.proc.poll() is None:
                c.proc.send_signal(sig)

    async def stop(self, timeout_s: float) -> None:
        """SIGTERM each (a front drains its own requests), wait ``timeout_s``, then kill."""
        self.stopping = True
        self.signal_all(15)
        deadline = time.monotonic() + timeout_s
        while any(c.proc is not None and c.proc.poll() is None for c in self.children):
            if time.monotonic() > deadline:
                log.warning("%s still running after %.0fs; killing them", self.module, timeout_s)
                self.signal_all(9)
                break
            await asyncio.sleep(0.05)


EXIT_WITH_PARENT = "PAGEDSERVE_FRONT_EXIT_WITH_PARENT"  # set by the scheduler for the fronts it starts


def exit_with_parent() -> None:
    """A front the scheduler started must not outlive it (Linux: the parent's death sends SIGTERM)."""
    if os.environ.get(EXIT_WITH_PARENT) and hasattr(ctypes, "CDLL"):
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
