"""The first engine core's view of the others: their load for the executor directory, their metrics.

With ``--engine-cores M`` the scheduler process is core 0 and dials cores 1..M-1 on their local
front links, as a front that submits nothing (:class:`OtherCores` is the sink of those links).
From their Status it knows how many executors each schedules, which is what the directory on the
executor port uses (:meth:`director`: an executor goes to the core with the fewest, counting
those just sent there); every second it asks each for its own metrics, and the deployment's
/metrics sums them with core 0's and the fronts'. A core that has not answered yet in its first
``STARTING_GRACE_S`` counts as starting: it may be sent executors (their handshakes wait in ZeroMQ
until it listens, and an executor that hears nothing goes back to the directory), so executors
that were up before the cores are spread over all of them, not all given to core 0. A core that
is lost has its count taken as unknown (it gets no executor) until it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pagedserve import wire
from pagedserve.engine_api import EngineStats
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.front.core_link import RemoteCore
from scheduler_svc.front.core_set import sum_stats
from scheduler_svc.telemetry.families import CumulativeSources

log = logging.getLogger(__name__)
METRICS_EVERY_S = 1.0
STARTING_GRACE_S = 30.0  # a core not heard from this long after the start is lost, not starting


class OtherCores:
    def __init__(self, core: EngineCore, endpoints: list[str], executor_port: int) -> None:
        self.core = core  # core 0, in this process
        self.executor_port = executor_port  # core k schedules on this port + k
        self.peers = [RemoteCore(e, "core-0", None, None) for e in endpoints]
        self.sent = [0] * (len(endpoints) + 1)  # executors sent to each core since its last Status
        self._families = CumulativeSources()  # by core process (one restarted counts from 0 again)
        self._family_keys: dict[int, tuple[int, int]] = {}  # core -> the key of its latest process
        self._task: asyncio.Task | None = None
        self._started = time.monotonic()
        for peer in self.peers:
            peer.attach(self)

    async def start(self) -> None:
        for peer in self.peers:
            await peer.start()
        self._task = asyncio.create_task(self._poll_metrics(), name="other-cores-metrics")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for peer in self.peers:
            await peer.close()

    # ------------------------------------------------------------------ the directory

    def director(self, hs: wire.Handshake) -> int | None:
        """The port of the core that is to schedule a new executor (None: this one, core 0)."""
        starting = time.monotonic() - self._started < STARTING_GRACE_S
        counts = [sum(1 for s in self.core.slots.values() if s.conn.state != "dead") + self.sent[0]]
        for k, peer in enumerate(self.peers, 1):
            if peer.connected:
                counts.append(len(peer.stats().executors) + self.sent[k])
            elif peer.status is None and starting:  # (not up yet: the executor's handshake waits for it)
                counts.append(self.sent[k])
            else:
                counts.append(float("inf"))
        k = min(range(len(counts)), key=lambda i: (counts[i], i))
        if k == 0:
            return None
        self.sent[k] += 1
        return self.executor_port + k

    # ------------------------------------------------------------------ what core 0 reads

    def deployment_stats(self) -> EngineStats:
        return sum_stats([self.core.stats(), *(p.stats() for p in self.peers if p.connected)])

    def families(self) -> list:
        """The other cores' own metrics, summed (their vllm: gauges left out: core 0 computes the
        deployment's from every core's stats)."""
        return [f for f in self._families.total() if not f[0].startswith("vllm:")]

    async def _poll_metrics(self) -> None:
        while True:
            await asyncio.sleep(METRICS_EVERY_S)
            try:
                await self.poll_metrics_once()
            except Exception:  # (a bug here must not end the polling, nor go unseen)
                log.exception("summing the other engine cores' metrics failed")

    async def poll_metrics_once(self) -> None:
        for i, peer in enumerate(self.peers):
            if not peer.connected:
                continue
            try:
                families = await peer.families(timeout_s=METRICS_EVERY_S)
            except Exception as exc:  # noqa: BLE001  (a lost or slow core keeps its last figures)
                log.debug("engine core %d sent no metrics: %r", i + 1, exc)
                continue
            key = (i, peer.incarnation)  # (read after the answer: the hello came before it)
            if self._family_keys.setdefault(i, key) != key:  # it restarted: what it had counted stays
                self._families.gone(self._family_keys[i])
                self._family_keys[i] = key
            self._families.update(key, families)

    # ------------------------------------------------------------------ the links' sink (nothing is submitted)

    def deliver(self, updates) -> None:
        pass

    def status_changed(self, peer: RemoteCore) -> None:
        k = self.peers.index(peer) + 1
        self.sent[k] = 0  # (its Status counts the executors we sent it)

    def core_lost(self, peer: RemoteCore, exc: Exception) -> None:
        log.warning("engine core %d is lost: %s", self.peers.index(peer) + 1, exc)
