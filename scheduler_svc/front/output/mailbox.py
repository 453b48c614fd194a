"""A request's outputs on their way to its consumer: the front's per-request mailbox.

``Tracked`` holds the request's :class:`~scheduler_svc.front.output.deltas.RequestStream` (detokenization,
stop strings, usage) and the single-consumer mailbox its
:class:`~scheduler_svc.front.output.stream.OutputStream` reads.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pagedserve.engine_api import RequestOutput
from scheduler_svc.front.output.deltas import RequestStream, merge_outputs


@dataclass(slots=True, eq=False)
class Tracked:
    """A request as its front follows it, whichever executor or engine core runs it.

    Its outputs reach the consumer (:class:`~scheduler_svc.front.output.stream.OutputStream`)
    through a minimal single-consumer mailbox: the consumer's ``waiter`` while it
    waits, else ``outbox``. An asyncio.Queue costs several times more per token,
    and the engine puts one output per request per step.

    ``--stream-interval`` N > 1 is applied here, before the mailbox: after the first
    output, outputs wait in ``held`` until one choice has N new tokens, the request
    finishes or fails, and then go to the consumer merged, with one wake-up. Holding
    them at the fronts instead cost a wake-up per token: at N = 4, 14.4 vs 12.3 us of
    the scheduler's CPU per streamed gRPC token (docs/PERF.md, "Streaming cost of the fronts").
    """

    stream: RequestStream
    interval: int = 1  # --stream-interval
    outbox: list = field(default_factory=list)  # RequestOutput | Exception put while nobody waited, oldest first
    waiter: asyncio.Future | None = None  # the consumer's, while it waits for the next output
    ended: bool = False  # the last item (the finished output, or an error) has been put
    held: list = field(default_factory=list)  # outputs held back for the interval, oldest first
    held_tokens: dict[int, int] | None = None  # per choice, tokens in ``held`` (interval > 1, after the first output)
    core_id: str = ""  # its id in the engine core (unique there; the client's may not be)

    @property
    def request_id(self) -> str:
        return self.stream.req.request_id

    def put(self, out: RequestOutput) -> None:
        if out.finished:
            self.ended = True
        elif self.held_tokens is not None:
            if self._holds(out):
                return
        elif self.interval > 1:
            self.held_tokens = {}  # the first output goes at once; the ones after it are held
        if self.held:  # released: what was held goes with it
            self.held.append(out)
            out = merge_outputs(self.held)
            self.held = []
        w = self.waiter  # (_hand, inlined: this runs for every request every step)
        if w is not None:
            self.waiter = None
            if not w.done():  # (cancelled: its consumer stopped waiting; the output waits below)
                w.set_result(out)
                return
        self.outbox.append(out)

    def _holds(self, out: RequestOutput) -> bool:
        """Hold ``out`` back, unless it brings one choice to the interval."""
        counts = self.held_tokens
        top = 0
        for c in out.choices:
            n = counts[c.index] = counts.get(c.index, 0) + len(c.token_ids)  # type: ignore[index]
            top = max(top, n)
        if top < self.interval:
            self.held.append(out)
            return True
        counts.clear()  # type: ignore[union-attr]
        return False

    def put_error(self, exc: Exception) -> None:
        """End the consumer's stream with ``exc`` (raised where it awaits its next output), after
        the outputs still held: no generated token is lost."""
        self.ended = True
        if self.held:
            held, self.held = self.held, []
            self._hand(merge_outputs(held))
        self._hand(exc)

    def _hand(self, item: RequestOutput | Exception) -> None:
        w = self.waiter
        if w is not None:
            self.waiter = None
            if not w.done():
                if isinstance(item, Exception):
                    w.set_exception(item)
                else:
                    w.set_result(item)
                return
        self.outbox.append(item)
