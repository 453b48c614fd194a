"""What the engine keeps per request and per executor.

``Tracked`` follows one request across executors (its output stream and a
single-consumer mailbox the gRPC handler reads); ``ExecutorSlot`` is one
registered executor: its connection, its own Scheduler (its KV pool) and the
inbox of additions and aborts that only its engine loop applies.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from scheduler_svc.executors import ExecutorConn
from scheduler_svc.outputs import RequestStream
from scheduler_svc.request import MigratedRequest
from scheduler_svc.scheduler import Scheduler


@dataclass(slots=True, eq=False)
class Tracked:
    """A request as the engine follows it, across executors.

    ``outbox`` + ``waiter`` is a minimal single-consumer mailbox: an
    asyncio.Queue costs several times more per token, and the engine pushes
    one item per request per step.
    """

    stream: RequestStream
    outbox: list = field(default_factory=list)  # RequestOutput | Exception, oldest first
    waiter: asyncio.Future | None = None
    slot: ExecutorSlot | None = None
    migrations: int = 0
    resume: MigratedRequest | None = None  # set while waiting to be re-queued elsewhere
    loop: asyncio.AbstractEventLoop | None = None  # the consumer's, cached by arrival()

    @property
    def request_id(self) -> str:
        return self.stream.req.request_id

    def put(self, item) -> None:
        self.outbox.append(item)
        w = self.waiter
        if w is not None and not w.done():
            w.set_result(None)

    def arrival(self) -> asyncio.Future | None:
        """None when items wait in ``outbox``, else a future the next :meth:`put` completes.

        The consumer awaits the future itself and then takes ``outbox``: a coroutine here
        would add a frame to resume on every wake-up (one per request per step).
        """
        if self.outbox:
            return None
        loop = self.loop
        if loop is None:
            # Looked up once per request: on Python 3.11 get_running_loop() is a getpid() system
            # call (a fork check), which was a fifth of the engine's CPU per step.
            loop = self.loop = asyncio.get_running_loop()
        w = self.waiter = loop.create_future()
        return w

    def take(self) -> list:
        """Everything put since the last take, oldest first."""
        items, self.outbox = self.outbox, []
        return items


@dataclass(slots=True, eq=False)
class ExecutorSlot:
    conn: ExecutorConn
    scheduler: Scheduler
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    adds: list[Tracked] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    requests: dict[str, Tracked] = field(default_factory=dict)
    task: asyncio.Task | None = None
    pending_blocks: int = 0  # prompt blocks of ``adds`` (kept, not summed: routing reads it per request)
    unpublished: list = field(default_factory=list)  # RequestUpdates applied, not yet streamed

    @property
    def id(self) -> str:
        return self.conn.id

    def add(self, t: Tracked) -> None:
        self.adds.append(t)
        self.pending_blocks += self._blocks(t)

    def remove_add(self, t: Tracked) -> None:
        self.adds.remove(t)
        self.pending_blocks -= self._blocks(t)

    def take_adds(self) -> list[Tracked]:
        adds, self.adds, self.pending_blocks = self.adds, [], 0
        return adds

    def _blocks(self, t: Tracked) -> int:
        return -(-len(t.stream.req.prompt_token_ids) // self.scheduler.config.block_size)
