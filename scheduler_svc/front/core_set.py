"""A front's engine cores: which one runs a request, and what happens to its requests when one is lost.

:class:`CoreSet` is the ``CoreApi`` a front's streams use, over one :class:`RemoteCore` per engine
core (``--core``, once per core; the scheduler's own fronts get every core of it). A new request
goes to a ready core that can hold it, within the skew bound of the least loaded (pagedserve/placement.py)
(the cores' running and waiting requests, from their Status, plus what this front sent since):
the one its prompt's first block hashes to (rendezvous hashing, so that every front sends a
shared prefix to the same core, where its blocks are cached), else the least loaded. Each executor is scheduled by exactly one core; the first
core's port is their directory (``HandshakeReply.redirect_port``), so executors spread over the
cores and come back to the directory when theirs is lost.

When a core is lost (silent for ``DEAD_AFTER_INTERVALS`` heartbeats), each request it ran moves to
another ready core with the tokens this front streamed of it (``Submit.resume_*``, as a migration
between executors), at most ``--max-migrations`` times; with no core left it fails with
``NO_EXECUTOR`` (UNAVAILABLE). None waits for a core that may never come back.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import math
import time

from pagedserve.engine_api import EngineError, EngineStats, ErrorKind, GenerationRequest, ModelInfo
from pagedserve.placement import within_skew
from scheduler_svc.front.core_link import RemoteCore
from scheduler_svc.telemetry.metrics_server import EXPOSITION_TTL_S


class CoreSet:
    def __init__(self, cores: list[RemoteCore], max_migrations: int = 3, report_core_health: bool = True) -> None:
        self._metrics: tuple[str, float] = ("", -math.inf)  # (text, when): the deployment's metrics
        self._metrics_ask: asyncio.Future | None = None
        self.cores = cores
        self.max_migrations = max_migrations
        self.report_core_health = report_core_health
        self.streams = None  # the FrontStreams the cores' updates go to (attach())
        self.where: dict[str, RemoteCore] = {}  # request (core id) -> the core running it
        self.moves: dict[str, int] = {}  # request -> times it moved to another core
        self.sent: dict[int, int] = {}  # id(core) -> requests sent since its last Status (load between them)
        for i, core in enumerate(cores):
            core.id = f"core-{i}"
            core.attach(self)

    def attach(self, streams) -> None:
        self.streams = streams

    async def start(self) -> None:
        for core in self.cores:
            await core.start()

    async def close(self) -> None:
        for core in self.cores:
            await core.close()

    # ------------------------------------------------------------------ what the front reads

    def _ready(self) -> list[RemoteCore]:
        return [c for c in self.cores if c.is_ready()]

    def is_ready(self) -> bool:
        return any(c.is_ready() for c in self.cores)

    def model_info(self) -> ModelInfo | None:
        """What a request may ask for: the most some ready core can hold (as one core's own
        executors do, a core with less only narrows where a request can go)."""
        infos = [i for c in (self._ready() or self.cores) if (i := c.model_info()) is not None]
        if not infos:
            return None
        return dataclasses.replace(infos[0], max_model_len=max(i.max_model_len for i in infos),
                                   num_executors=sum(i.num_executors for i in infos),
                                   max_request_blocks=max(i.max_request_blocks for i in infos))

    def stats(self) -> EngineStats:
        return sum_stats([c.stats() for c in self.cores])

    async def update_lora(self, name: str, path: str | None):
        """The same LoRA load or unload on every engine core (each serves its own executors); the
        first answer that says it was not done, else the first."""
        answers = [await c.update_lora(name, path) for c in self.cores if c.connected]
        if not answers:
            raise EngineError(ErrorKind.NO_EXECUTOR, "no engine core is reachable; try again")
        return next((a for a in answers if a.error is not None), answers[0])

    async def current_stats(self) -> EngineStats:
        return sum_stats([await c.current_stats() if c.connected else c.stats() for c in self.cores])

    def health_problem(self) -> str | None:
        """A core's broken loop, for the liveness of fronts the scheduler started (restarting its pod
        is the cure); a front of its own reports none: restarting it would not mend the core."""
        if not self.report_core_health:
            return None
        return next((p for c in self.cores if (p := c.health_problem()) is not None), None)

    async def metrics_text(self, timeout_s: float = 5.0) -> str:
        """The deployment's metrics: the first core sums every core's and every front's. Asked of it
        at most every ``EXPOSITION_TTL_S`` (it renders them no more often), one ask shared by every scrape meanwhile: ``/metrics`` on the
        API port is open, and a flood of scrapes must not reach the core's loop one by one."""
        text, at = self._metrics
        if time.monotonic() - at <= EXPOSITION_TTL_S:
            return text
        if self._metrics_ask is None:
            self._metrics_ask = asyncio.ensure_future(self._ask_metrics(timeout_s))
            self._metrics_ask.add_done_callback(lambda f: f.cancelled() or f.exception())  # (its scrapers may be gone)
        return await asyncio.shield(self._metrics_ask)  # (a scraper gone does not cancel the others' ask)

    async def _ask_metrics(self, timeout_s: float) -> str:
        try:
            text = await self.cores[0].metrics_text(timeout_s)
            self._metrics = (text, time.monotonic())
            return text
        finally:
            self._metrics_ask = None

    # ------------------------------------------------------------------ what the front asks

    def submit(self, req: GenerationRequest, sink) -> None:
        core = self._choose(req)
        core.submit(req, self)
        self.where[req.request_id] = core
        self.sent[id(core)] = self.sent.get(id(core), 0) + 1

    def abort(self, request_id: str) -> None:
        core = self.where.pop(request_id, None)
        self.moves.pop(request_id, None)
        if core is not None:
            core.abort(request_id)

    def finish_choice(self, request_id: str, index: int) -> None:
        core = self.where.get(request_id)
        if core is not None:
            core.finish_choice(request_id, index)

    def _choose(self, req: GenerationRequest, exclude: RemoteCore | None = None) -> RemoteCore:
        """The core for ``req``: among the ready cores that can hold it and are within the router's
        skew bound of the least loaded, the one its prompt's first block hashes to (rendezvous
        hashing: every front chooses the same core for the same prefix, so a prefix shared across
        fronts meets its cached blocks), else the least loaded."""
        ready = [c for c in self._ready() if c is not exclude]
        fits = [c for c in ready if _fits(c, req)] or ready
        if not fits:
            raise EngineError(ErrorKind.NO_EXECUTOR, _none_ready([c for c in self.cores if c is not exclude]))
        loads = {id(c): self._load(c) for c in fits}
        eligible = [fits[i] for i in within_skew([loads[id(c)] for c in fits])]
        first = (req.prompt_block_hashes or [b""])[0]
        return max(eligible, key=lambda c: (_affinity(first, c.endpoint) if first else 0, -loads[id(c)]))

    def _load(self, core: RemoteCore) -> int:
        st = core.stats()
        return st.num_running + st.num_waiting + self.sent.get(id(core), 0)

    # ------------------------------------------------------------------ from the cores

    def deliver(self, updates) -> None:
        """A core's step (updates of this front's requests): ended ones leave the map."""
        for upd in updates:
            if upd.finished:
                self.where.pop(upd.request_id, None)
                self.moves.pop(upd.request_id, None)
        self.streams.deliver(updates)

    def status_changed(self, core: RemoteCore) -> None:
        self.sent[id(core)] = 0  # (its Status counts what we sent it)

    def core_lost(self, core: RemoteCore, exc: Exception) -> None:
        """``core`` is gone: what it ran moves to another core, or fails."""
        streams = self.streams
        streams.stream_pending()  # (what it handed over before it went is streamed first: resume after it)
        for rid in [rid for rid, c in self.where.items() if c is core]:
            del self.where[rid]
            t = streams.by_core_id.get(rid)
            if t is None or t.ended:
                continue
            moves = self.moves[rid] = self.moves.get(rid, 0) + 1
            try:
                if moves > self.max_migrations:
                    raise EngineError(ErrorKind.NO_EXECUTOR, f"request moved {moves - 1} times after engine cores "
                                      f"were lost (max_migrations={self.max_migrations}); last: {exc}")
                target = self._choose(t.stream.req, exclude=core)
                target.submit(streams.resumed(t), self, resume=streams.resume_of(t))
            except EngineError as err:  # (NO_EXECUTOR: no engine core can take it)
                self.moves.pop(rid, None)
                streams.fail_request(t, err if moves > self.max_migrations or self._ready() else exc)
                continue
            self.where[rid] = target


def _none_ready(cores: list[RemoteCore]) -> str:
    """Why none of ``cores`` takes a request, as their last Status tells: a core that answers but
    whose executors all drain is not unreachable, and the client should hear which it is."""
    up = [c for c in cores if c.connected]
    if not up:
        return "no engine core is reachable; try again"
    states = [e.state for c in up for e in c.stats().executors if e.state != "dead"]
    if "draining" in states and "ready" not in states:
        return (f"the executors are all draining ({states.count('draining')}: each finishes its requests, then "
                "leaves); try again once another has registered")
    if not states:
        return "no executor is connected to the engine core; try again once one has registered"
    return "no engine core is ready (it may be shutting down); try again"


def _fits(core: RemoteCore, req: GenerationRequest) -> bool:
    info = core.model_info()
    return info is not None and len(req.prompt_token_ids) < info.max_model_len


def _affinity(block_hash: bytes, core: str) -> int:
    """Rendezvous weight of a prompt's first block on a core: the same on every front."""
    return int.from_bytes(hashlib.blake2b(block_hash + core.encode(), digest_size=8).digest(), "big")


def sum_stats(all_stats: list[EngineStats]) -> EngineStats:
    out = EngineStats()
    for st in all_stats:
        out.num_running += st.num_running
        out.num_waiting += st.num_waiting
        out.num_swapped += st.num_swapped
        out.num_preemptions += st.num_preemptions
        out.prefix_cache_query_tokens += st.prefix_cache_query_tokens
        out.prefix_cache_hit_tokens += st.prefix_cache_hit_tokens
        out.num_migrations += st.num_migrations
        out.executors += st.executors
        out.spec_num_drafts += st.spec_num_drafts
        out.spec_num_draft_tokens += st.spec_num_draft_tokens
        out.spec_num_accepted_tokens += st.spec_num_accepted_tokens
        per_pos = out.spec_accepted_per_pos
        per_pos += [0] * (len(st.spec_accepted_per_pos) - len(per_pos))
        for i, n in enumerate(st.spec_accepted_per_pos):
            per_pos[i] += n
        out.lora_running = sorted({*out.lora_running, *st.lora_running})
        out.lora_waiting = sorted({*out.lora_waiting, *st.lora_waiting})
        out.max_lora = max(out.max_lora, st.max_lora)
    return out
