"""How many calls, and how many request bytes, the public fronts of one process hold at once.

Both fronts share one :class:`CallBudget` (``--max-concurrent-calls``, ``--max-in-flight-bytes``).
A call takes a slot when it starts, before its request is read, and charges its request bytes
before they are read: an HTTP body from its Content-Length (or chunk by chunk when it has
none). A gRPC message's size is not known until it has arrived (grpc reads it whole), so the
call reserves room for a message of the largest size while its message is read, and keeps
only the message's size once it has arrived, before it is parsed. (The gRPC server's receive
window stays 64 KiB per call until then: grpc_limits.py.) Slot and bytes come back when the
call ends, however it ends (its response streamed to the end, rejected, cancelled). A call the
budget cannot take is rejected at once with 429 / RESOURCE_EXHAUSTED; the calls in progress
are untouched. Only a gRPC reservation that finds the room taken by other reservations waits
for them, since they shrink within moments: a burst of small calls is not rejected for the size
their messages might have had. Health checks are not counted, so probes pass under load.

This sits in front of the engine's own bound, ``--max-queued-requests`` (admitted requests
waiting for an executor): a request rejected here was never read, validated or tokenized.
``--max-concurrent-calls`` should exceed what the engine holds (the queue plus
``--max-num-seqs`` per executor), or callers get 429 from the front before the queue is full.
``--max-in-flight-bytes`` must hold at least one request of the largest size either front
accepts (``--http-max-body-bytes``, gRPC's 4 MiB message limit); config.py checks that.

The budget is used from the event loop only (both fronts run there), so it needs no lock.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from scheduler_svc.front.input.server_limits import ServerLimits

log = logging.getLogger(__name__)
MiB = 1 << 20
# Sizing for the machine (a cap given as 0): from the memory and CPUs the process may use, its
# cgroup's limits where it has them (a Kubernetes pod's), else the machine's.
MEMORY_PER_CALL = 1 * MiB  # a call's own state (task, streams, HTTP/2 buffers) is far below this
# A front's CPU per streamed token is tens of µs (docs/PERF.md "Streaming cost of the fronts"):
# a core streams some 15-30k tokens/s, ~1,000 streams at 15-30 tokens/s each. More calls than
# that only queue for the CPU.
CALLS_PER_CPU = 1024
CALLS_RANGE = (256, 16384)
IN_FLIGHT_FRACTION = 8  # request bytes grow ~2-3x while parsed (raw, message, text): <= ~3/8 of memory
IN_FLIGHT_RANGE = (64 * MiB, 1024 * MiB)
MAX_CONCURRENT_CALLS, MAX_IN_FLIGHT_BYTES = "max_concurrent_calls", "max_in_flight_bytes"  # rejection reasons


class Shed(Exception):
    """A call rejected for want of budget: ``reason`` is the cap's name (max_concurrent_calls or
    max_in_flight_bytes); the message names the flag, its value and what the call needed."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(slots=True, eq=False)
class Ticket:
    """One call's share of the budget: a slot, and its request bytes (``nbytes``, of which
    ``reserved`` are held for a message still being read)."""

    budget: CallBudget
    nbytes: int = 0
    reserved: int = 0
    released: bool = False

    def charge(self, nbytes: int) -> None:
        """Add ``nbytes`` to this call's request bytes; Shed (nothing charged) if they do not fit."""
        self.budget._take_bytes(nbytes, self.nbytes)
        self.nbytes += nbytes

    async def reserve(self, nbytes: int) -> None:
        """Hold ``nbytes`` for a message about to be read whose size is not known yet (gRPC's).
        When what other calls hold leaves no room, Shed at once; when only other reads' reservations
        stand in the way (they turn into their messages' sizes within moments), wait for them."""
        budget = self.budget
        while budget.bytes + nbytes > budget.max_bytes:
            if budget.bytes - budget.reserved + nbytes > budget.max_bytes:
                raise Shed(MAX_IN_FLIGHT_BYTES, f"the server holds --max-in-flight-bytes ({budget.max_bytes}) of "
                                                f"request bytes in progress; a gRPC call needs room for a message of "
                                                f"the largest size ({nbytes}) while it is read; retry later")
            await budget._wait()
        budget.bytes += nbytes
        budget.reserved += nbytes
        self.nbytes += nbytes
        self.reserved += nbytes

    def settle(self, nbytes: int) -> None:
        """The message has arrived: its ``nbytes`` replace the reservation (Shed if they do not fit)."""
        self._unreserve()
        self.charge(nbytes)

    def release(self) -> None:
        """Give the slot and the bytes back (idempotent)."""
        if not self.released:
            self.released = True
            self._unreserve()
            self.budget.calls -= 1
            self.budget.bytes -= self.nbytes
            self.nbytes = 0
            self.budget._wake()

    def _unreserve(self) -> None:
        if self.reserved:
            self.budget.bytes -= self.reserved
            self.budget.reserved -= self.reserved
            self.nbytes -= self.reserved
            self.reserved = 0
            self.budget._wake()


class CallBudget:
    def __init__(self, max_calls: int, max_bytes: int) -> None:
        if max_calls < 1 or max_bytes < 1:
            raise ValueError(f"CallBudget: caps must be >= 1 (got {max_calls} calls, {max_bytes} bytes)")
        self.max_calls, self.max_bytes = max_calls, max_bytes
        self.calls = 0  # calls holding a slot
        self.bytes = 0  # their request bytes, reservations included
        self.reserved = 0  # held for messages still being read
        self._waiters: list[asyncio.Future[None]] = []

    @classmethod
    def from_limits(cls, limits: ServerLimits) -> CallBudget:
        sized = sized_for_machine(limits)
        return cls(sized.max_concurrent_calls, sized.max_in_flight_bytes)

    def enter(self, nbytes: int = 0) -> Ticket:
        """A slot for a new call, with ``nbytes`` of request already known; Shed if either cap is full."""
        if self.calls >= self.max_calls:
            raise Shed(MAX_CONCURRENT_CALLS, f"the server has --max-concurrent-calls ({self.max_calls}) calls in "
                                             "progress; retry later")
        self._take_bytes(nbytes, 0)
        self.calls += 1
        return Ticket(self, nbytes)

    def _take_bytes(self, nbytes: int, held: int) -> None:
        if self.bytes + nbytes > self.max_bytes:
            raise Shed(MAX_IN_FLIGHT_BYTES, f"the server holds --max-in-flight-bytes ({self.max_bytes}) of request "
                                            f"bytes in progress; this request has {held + nbytes}; retry later")
        self.bytes += nbytes

    async def _wait(self) -> None:
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        finally:
            if waiter in self._waiters:  # (cancelled while waiting)
                self._waiters.remove(waiter)

    def _wake(self) -> None:
        """Bytes came back: every waiting reservation looks again."""
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)


def memory_limit_bytes() -> int:
    """The memory this process may use: its cgroup's limit (v2, else v1) when lower than the RAM."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max": no limit
            return min(ram, int(text))
    return ram


def cpu_limit() -> float:
    """The CPUs this process may use: its affinity, or its cgroup's quota (v2 cpu.max) when lower."""
    cpus = float(len(os.sched_getaffinity(0)))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return cpus
    return min(cpus, int(quota) / int(period)) if quota.isdigit() and period.isdigit() else cpus


def sized_for_machine(limits: ServerLimits, memory_bytes: int | None = None, cpus: float | None = None,
                      share: int = 1) -> ServerLimits:
    """``limits`` with each cap given as 0 sized for the machine: calls, one per MiB of the memory
    the process may use and at most 1024 per CPU (256..16384); request bytes, an eighth of that
    memory (64 MiB..1 GiB). ``share``: processes that split the machine's budget (the scheduler's
    fronts: each gets its share)."""
    wanted = {name for name in ServerLimits.MACHINE_SIZED if not getattr(limits, name)}
    if not wanted:
        return limits
    memory = (memory_limit_bytes() if memory_bytes is None else memory_bytes) // max(1, share)
    cpus = (cpu_limit() if cpus is None else cpus) / max(1, share)
    calls = min(memory // MEMORY_PER_CALL, int(CALLS_PER_CPU * cpus))
    sized = {MAX_CONCURRENT_CALLS: _clamp(calls, CALLS_RANGE),
             MAX_IN_FLIGHT_BYTES: _clamp(memory // IN_FLIGHT_FRACTION, IN_FLIGHT_RANGE)}
    return dataclasses.replace(limits, **{name: sized[name] for name in wanted})


def _clamp(value: int, bounds: tuple[int, int]) -> int:
    return max(bounds[0], min(bounds[1], value))
