"""What the engine core keeps per request and per executor.

``CoreRequest`` is a request as the core follows it across its executors: the front that owns
it (where its updates go), the executor it runs on and what moves with it when it migrates.
``ExecutorSlot`` is one registered executor: its connection, its own Scheduler (its KV pool), the
inbox of additions, aborts and finished choices that only its engine loop applies, the requests
it runs and the updates applied but not yet handed to their fronts. ``SchedulerCounters`` sums the
counters of schedulers, those of executors gone included.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine_api import EngineStats, GenerationRequest
from scheduler_svc.engine.executor_conn import ExecutorConn
from scheduler_svc.sched.request import MigratedRequest
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.speculative_steps import SpecCounters


@dataclass(slots=True, eq=False)
class CoreRequest:
    """A request as the engine core follows it, across its executors."""

    req: GenerationRequest
    sink: Any  # engine_core.UpdateSink: the front its updates go to
    slot: ExecutorSlot | None = None
    migrations: int = 0
    resume: MigratedRequest | None = None  # set while waiting to be re-queued elsewhere
    parked: asyncio.TimerHandle | None = None  # waiting for an executor: when it gives up (--orphan-timeout)
    expiry: asyncio.TimerHandle | None = None  # its client's deadline, when the core ends it
    ended: bool = False  # finished, failed or aborted: nothing more goes to its front

    @property
    def request_id(self) -> str:
        return self.req.request_id

    def end(self) -> None:
        """Nothing more goes to its front; its deadline timer (holding it, prompt and all) goes."""
        self.ended = True
        if self.expiry is not None:
            self.expiry.cancel()
            self.expiry = None


@dataclass(slots=True, eq=False)
class ExecutorSlot:
    conn: ExecutorConn
    scheduler: Scheduler
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    adds: list[CoreRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    finished_choices: list[tuple[str, int]] = field(default_factory=list)  # (request id, choice) a stop string ended
    requests: dict[str, CoreRequest] = field(default_factory=dict)
    task: asyncio.Task | None = None
    queued_blocks: int = 0  # prompt blocks of ``adds`` (kept, not summed: routing reads it per request)
    unpublished: list = field(default_factory=list)  # RequestUpdates applied, not yet handed to their fronts
    failed_steps: int = 0  # consecutive steps failed as a whole or refused (--max-failed-steps)

    @property
    def id(self) -> str:
        return self.conn.id

    def add(self, t: CoreRequest) -> None:
        self.adds.append(t)
        self.queued_blocks += self._blocks(t)

    def remove_add(self, t: CoreRequest) -> None:
        self.adds.remove(t)
        self.queued_blocks -= self._blocks(t)

    def take_adds(self) -> list[CoreRequest]:
        adds, self.adds, self.queued_blocks = self.adds, [], 0
        return adds

    def _blocks(self, t: CoreRequest) -> int:
        return -(-len(t.req.prompt_token_ids) // self.scheduler.config.block_size)


@dataclass(slots=True)
class SchedulerCounters:
    """The counters of schedulers summed: preemptions, prefix-cache lookups and hits (tokens), and
    speculative decoding's. The engine keeps those of schedulers gone (a counter never goes back)
    and adds the live ones to them for its stats."""

    preemptions: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    spec: SpecCounters = field(default_factory=SpecCounters)

    def add(self, s: Scheduler) -> None:
        self.preemptions += s.num_preemptions
        self.prefix_query_tokens += s.prefix_cache_query_tokens
        self.prefix_hit_tokens += s.prefix_cache_hit_tokens
        if s.spec is not None:
            self.spec.add(s.spec.counters)

    def copy(self) -> SchedulerCounters:
        spec = SpecCounters()
        spec.add(self.spec)
        return SchedulerCounters(self.preemptions, self.prefix_query_tokens, self.prefix_hit_tokens, spec)

    def report(self, st: EngineStats) -> None:
        st.num_preemptions = self.preemptions
        st.prefix_cache_query_tokens, st.prefix_cache_hit_tokens = self.prefix_query_tokens, self.prefix_hit_tokens
        self.spec.report(st)
