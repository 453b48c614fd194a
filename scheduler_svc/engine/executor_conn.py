"""One executor as the executor link holds it: its connection, its state, the plans it has not answered.

The hub (executor_link.py) creates and updates these records; the handshake policy
(executor_admission.py) reads them to keep an executor id bound to one live connection, and the
engine core keeps each executor's record in its slot (state.py).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field

from pagedserve import wire


@dataclass(slots=True)
class SentPlan:
    """A plan sent to an executor and not yet answered: what its result frame must match."""

    step_id: int
    max_result_bytes: int  # the largest answer the plan can have (wire.max_result_bytes)
    result: asyncio.Future  # resolved with the decoded StepResult


@dataclass(slots=True, eq=False)
class ExecutorConn:
    identity: bytes
    info: wire.Handshake
    state: str = "ready"  # "ready" | "draining" | "dead"
    last_seen: float = field(default_factory=time.monotonic)
    in_flight: deque[SentPlan] = field(default_factory=deque)  # sent, not yet taken by next_result, oldest first
    discarded: set[int] = field(default_factory=set)  # step ids sent before a Reset: answers dropped unread
    oldest_since: float = 0.0  # when the oldest plan in flight started to run (as far as we know)
    step_seconds: float = 0.0  # moving average of the time between results
    drain_deadline: float | None = None
    peer_key: bytes | None = None  # the CURVE key (z85) its connection authenticated with; None without CURVE
    enrolled: bool = False  # got in with an enrollment proof (else its key is trusted, or there is no CURVE)

    @property
    def id(self) -> str:
        return self.info.executor_id
