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




async def handshake_replies(cfg: EngineConfig, handshakes: list) -> list:
    """Each handshake sent over its own DEALER socket to an engine started on ``cfg`` (a
    ``tcp://127.0.0.1:0`` executor endpoint), and the hub's replies, in order. Every connection is kept
    open until all have answered: an accepted executor stays live while the next one joins."""
    import asyncio

    import zmq
    import zmq.asyncio

    from pagedserve import wire
    from testing.grpc_fakes import make_tokenizer

    engine = Engine(cfg, make_tokenizer(), eos_token_ids=())
    await engine.start()
    ctx = zmq.asyncio.Context()
    socks, out = [], []
    try:
        for hs in handshakes:
            sock = ctx.socket(zmq.DEALER)
            sock.connect(f"tcp://127.0.0.1:{engine.hub.bound_port}")
            socks.append(sock)
            await sock.send(wire.encode(hs))
            out.append(wire.decode(await asyncio.wait_for(sock.recv(), 10)))
    finally:
        for sock in socks:
            sock.close(0)
        await engine.shutdown(0)
        ctx.term()
    return out
