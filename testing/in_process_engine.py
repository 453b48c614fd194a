"""The engine core and one front's streams in one process.

``Engine`` is :class:`~scheduler_svc.engine.core.EngineCore` (scheduling, executors, migration)
with :class:`~scheduler_svc.front.streams.FrontStreams` (detokenization, stop strings, streaming)
on the same event loop: the ``Engine`` protocol the gRPC servicer and the HTTP front use, in one
process. The tests and the engine benchmarks drive it; the scheduler service runs the same two
halves in separate processes (a core, and fronts of their own: ``scheduler_svc/front/core_link.py, scheduler_svc/engine/front_link.py``), so
that nothing done per token runs where plans are made.
"""

from __future__ import annotations

from collections.abc import Collection

from tokenizers import Tokenizer

from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.engine_config import EngineConfig
from scheduler_svc.front.streams import FrontStreams


class Engine(FrontStreams):
    def __init__(self, cfg: EngineConfig, tokenizer: Tokenizer, eos_token_ids: Collection[int],
                 metrics=None) -> None:
        self.cfg = cfg
        super().__init__(EngineCore(cfg, eos_token_ids, metrics), tokenizer, cfg.stream_interval, metrics)

    async def start(self) -> None:
        await self.core.start()

    async def shutdown(self, grace_s: float) -> None:
        """Stop admitting, let running requests finish for ``grace_s``, abort the rest, stop."""
        self.core.begin_shutdown()
        await super().shutdown(grace_s)
        await self.core.stop()

    # The core's parts that tests and benchmarks look at.
    @property
    def hub(self):
        return self.core.hub

    @property
    def slots(self):
        return self.core.slots

    @property
    def router(self):
        return self.core.router

    @property
    def num_steps(self) -> int:
        return self.core.num_steps

    @property
    def on_readiness_change(self):
        return self.core.on_readiness_change

    @on_readiness_change.setter
    def on_readiness_change(self, hook) -> None:
        self.core.on_readiness_change = hook


