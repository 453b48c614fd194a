"""Every rank watches the others; a dead rank takes the whole group out of service.

A thread per rank, every :data:`INTERVAL_S`, through its own connection to the group's
TCPStore (hosted by rank 0):

- beats: adds 1 to ``tp/beat/<rank>`` and reads everyone else's counter; a rank whose counter
  has not moved for :data:`PEER_SILENT_S` is dead or hung (multi-node: nothing else tells);
- children: the local leader polls the processes it started, so a kill -9 of any of them is
  seen within one interval;
- the store itself: when rank 0 dies its store goes with it, and the next call fails;
- drains: a follower that gets SIGTERM writes ``tp/drain``; the leader's watchdog sees it and
  starts the worker's drain, so SIGTERM to any rank drains the whole group.

Whatever it finds dead, it calls ``TPGroup.fatal``: this rank exits too. The leader's exit is
what the scheduler notices (its ZeroMQ peer vanishes, or falls silent), and it migrates the
executor's requests; a follower's exit is noticed by the leader's watchdog (or by its next
collective failing), which then exits in turn.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from executor_svc.parallel.group import GroupFailure, TPGroup, make_store

log = logging.getLogger(__name__)

INTERVAL_S = 0.2
PEER_SILENT_S = 5.0  # the scheduler's default heartbeat timeout (5 intervals of 1 s)
_DRAIN_KEY = "tp/drain"


class Watchdog(threading.Thread):
    def __init__(self, group: TPGroup, addr: str, port: int, interval_s: float = INTERVAL_S,
                 silent_s: float = PEER_SILENT_S) -> None:
        super().__init__(name=f"tp-watchdog-{group.rank}", daemon=True)
        self.group, self.addr, self.port = group, addr, port
        self.interval_s, self.silent_s = interval_s, silent_s
        self.on_drain: Callable[[], None] | None = None  # the leader's: start the worker's drain
        self._drain_requested = False  # a follower's SIGTERM (set from its signal handler)
        self._halt = threading.Event()

    def request_drain(self) -> None:
        """Signal-handler safe: the next turn tells the leader."""
        self._drain_requested = True

    def stop(self) -> None:
        """Before an orderly shutdown: children exiting then are not failures."""
        self._halt.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=5.0)

    def run(self) -> None:
        try:
            self._watch()
        except GroupFailure:
            return  # fatal() has acted (it exits the process; tests make it raise instead)

    def _watch(self) -> None:
        g = self.group
        try:
            store = make_store(self.addr, self.port, g.size, serve=False, timeout_s=5.0)
        except Exception as exc:  # noqa: BLE001 (any failure to reach rank 0 means the group is gone)
            g.fatal(f"watchdog cannot reach the group's store at {self.addr}:{self.port}: {exc}")
        seen: dict[int, tuple[int, float]] = {}  # rank -> (counter, when it last moved)
        drained = told = False
        last_turn = time.monotonic()
        while not self._halt.wait(self.interval_s):
            now = time.monotonic()
            starved, last_turn = now - last_turn > self.silent_s / 2, now  # our own thread was stalled
            try:
                store.add(f"tp/beat/{g.rank}", 1)
                self._check_children()
                for r in range(g.size):
                    if r != g.rank:
                        self._check_beat(r, store.add(f"tp/beat/{r}", 0), now, seen, starved)
                if self._drain_requested and not told:
                    store.set(_DRAIN_KEY, str(g.rank))
                    told = True
                if g.is_leader and not drained and self.on_drain is not None and store.check([_DRAIN_KEY]):
                    log.info("rank %s asked for a drain (SIGTERM): draining the group", store.get(_DRAIN_KEY).decode())
                    self.on_drain()
                    drained = True
            except GroupFailure:
                raise
            except Exception as exc:  # noqa: BLE001
                if self._halt.is_set():
                    return
                g.fatal(f"lost the group's store at {self.addr}:{self.port} ({type(exc).__name__}: {exc}): "
                        f"rank 0 is gone")

    def _check_children(self) -> None:
        for rank, proc in self.group.children.items():
            code = proc.poll()
            if code is not None and not self._halt.is_set():
                self.group.fatal(f"rank {rank} (pid {proc.pid}) exited with status {code}")

    def _check_beat(self, rank: int, count: int, now: float, seen: dict[int, tuple[int, float]],
                    starved: bool) -> None:
        last = seen.get(rank)
        if last is None or last[0] != count or starved:
            seen[rank] = (count, now)
        elif now - last[1] > self.silent_s and not self._halt.is_set():
            self.group.fatal(f"rank {rank} has been silent for {now - last[1]:.1f}s (dead or hung)")
