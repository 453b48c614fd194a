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
fronts keep serving the ports meanwhile. A front says when it serves (``front_ready.py``): one that
exits before it ever did is not started again, and :meth:`Children.wait_ready` gives its reason
(a bad flag, a port it cannot bind: every try would fail the same way). A child does not outlive the scheduler (Linux's parent
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

from scheduler_svc.entrypoints.front_ready import READY_FD, ReadyPipe

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
    pipe: ReadyPipe | None = None  # what the process now running says (ready_pipes only)
    ever_ready: bool = False  # this slot has served: an exit is a crash to recover from, not a bad start


@dataclass
class Children:
    module: str  # what each runs: python -m MODULE
    count: int
    args: Callable[[Child], list[str]]  # its command line (the scheduler's, and its own additions)
    name: Callable[[Child], str]
    on_exit: Callable[[str, str], None]  # (name, why)
    ready_pipes: bool = False  # each says when it serves (front_ready.py); one that never did is not restarted
    children: list[Child] = field(default_factory=list)
    stopping: bool = False
    failure: str | None = None  # why a child could not start (ready_pipes)
    _settled: asyncio.Event = field(default_factory=asyncio.Event)  # every child ready, or one failed

    def start(self) -> None:
        self.children = [Child(i) for i in range(self.count)]
        for c in self.children:
            self._spawn(c)
        if not self.ready_pipes:
            self._settled.set()

    async def wait_ready(self) -> str | None:
        """Once every child has served (None), or one exited before it did: why (``watch`` must run)."""
        if self.count:
            await self._settled.wait()
        return self.failure

    def _spawn(self, c: Child) -> None:
        c.generation += 1
        c.name = self.name(c)
        env = dict(os.environ, **{EXIT_WITH_PARENT: "1"})
        pipe = ReadyPipe() if self.ready_pipes else None
        if pipe is not None:
            env[READY_FD] = str(pipe.fd_for_child)
        try:
            c.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args(c)], env=env,
                                      pass_fds=(pipe.fd_for_child,) if pipe else ())
        except BaseException:
            if pipe is not None:
                pipe.close()
            raise
        finally:
            if pipe is not None:
                pipe.child_started()  # (its end is the child's alone: its exit closes the pipe)
        if c.pipe is not None:
            c.pipe.close()
        c.pipe = pipe
        c.started_at = time.monotonic()
        log.info("started %s (pid %d)", c.name, c.proc.pid)

    async def watch(self) -> None:
        """Start again what exits, until :meth:`stop` (polled: an exit is seen within 0.1 s)."""
        while not self.stopping:
            await asyncio.sleep(0.1)
            for c in self.children:
                if c.pipe is not None and not c.ever_ready:
                    c.pipe.poll()
                    if c.pipe.ready:
                        c.ever_ready = True
                        if all(child.ever_ready for child in self.children):
                            self._settled.set()
                if c.proc is None or c.proc.poll() is None or self.stopping:
                    continue
                why = f"exited with status {c.proc.returncode}"
                if self.ready_pipes and not c.ever_ready:
                    self._failed_to_start(c, why)
                    continue
                log.warning("%s %s; starting it again", c.name, why)
                c.quick_exits = 0 if time.monotonic() - c.started_at > 60 else c.quick_exits + 1
                c.proc = None
                try:
                    self.on_exit(c.name, why)
                except Exception:  # noqa: BLE001  a bug there must not stop this watch (nor the restart)
                    log.exception("handling the exit of %s failed", c.name)
                self._respawn_later(c)

    def _failed_to_start(self, c: Child, why: str) -> None:
        """A child that exited before it ever served: not started again (every try would fail alike)."""
        reason = c.pipe.failure() if c.pipe is not None else None
        self.failure = f"{c.name} could not start: {reason or why}"
        log.error("%s", self.failure)
        c.proc = None
        try:
            self.on_exit(c.name, why)
        except Exception:  # noqa: BLE001  (as in watch)
            log.exception("handling the exit of %s failed", c.name)
        self._settled.set()

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
        for c in self.children:
            if c.pipe is not None:
                c.pipe.close()


EXIT_WITH_PARENT = "PAGEDSERVE_FRONT_EXIT_WITH_PARENT"  # set by the scheduler for the fronts it starts


def exit_with_parent() -> None:
    """A front the scheduler started must not outlive it (Linux: the parent's death sends SIGTERM)."""
    if os.environ.get(EXIT_WITH_PARENT) and hasattr(ctypes, "CDLL"):
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
