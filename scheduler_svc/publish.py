"""Scheduler updates -> client streams: detokenize, stop strings, usage, metrics, mailboxes.

The engine loop calls this after each step's result. With asynchronous
scheduling it is split around the next plan: requests with stop strings are
settled first (a stop string is only visible in text, and finishing the choice
before the next plan is built means it is computed at most once more), then
the next plan goes out, and only then is everything else detokenized and
handed to its consumer, in chunks that yield to the event loop so another
executor's result is not held up behind this one's fan-out.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from scheduler_svc.api_types import FinishReason, RequestFailed, RequestOutput
from scheduler_svc.request import RequestUpdate
from scheduler_svc.slots import ExecutorSlot, Tracked

CHUNK = 64  # updates published between yields to the event loop


class Publisher:
    def __init__(self, metrics, tracked: dict[str, Tracked], fail: Callable[[Tracked, Exception], None]) -> None:
        self.metrics = metrics
        self.tracked = tracked  # the engine's request_id -> Tracked (finished requests leave it here)
        self.fail = fail

    def settle_stops(self, slot: ExecutorSlot, updates: list[RequestUpdate]) -> list[RequestUpdate]:
        """Publish at once what may end by a stop string; return the rest for :meth:`publish`."""
        rest = []
        for upd in updates:
            t = slot.requests.get(upd.request_id)
            if t is not None and t.stream.req.params.stop:
                self._one(slot, t, upd)
            else:
                rest.append(upd)
        return rest

    async def publish(self, slot: ExecutorSlot, updates: list[RequestUpdate]) -> None:
        for i in range(0, len(updates), CHUNK):
            if i:
                await asyncio.sleep(0)  # let other executors' results through
            self.publish_now(slot, updates[i:i + CHUNK])

    def publish_now(self, slot: ExecutorSlot, updates: list[RequestUpdate]) -> None:
        requests = slot.requests
        for upd in updates:
            t = requests.get(upd.request_id)
            if t is not None:  # else aborted while the step ran
                self._one(slot, t, upd)

    def _one(self, slot: ExecutorSlot, t: Tracked, upd: RequestUpdate) -> None:
        if upd.error:
            slot.requests.pop(upd.request_id, None)
            self.fail(t, RequestFailed(f"executor {slot.id} failed the step: {upd.error}"))
            return
        prev_token_at = t.stream.last_token_at
        out, stopped = t.stream.apply(upd)
        for index in stopped:
            slot.scheduler.finish_sequence(upd.request_id, index, FinishReason.STOP)
        if self.metrics:
            self._account(t, out, prev_token_at)
        if out.choices or out.finished:
            t.put(out)
        if out.finished:
            slot.requests.pop(upd.request_id, None)
            self.tracked.pop(upd.request_id, None)

    def _account(self, t: Tracked, out: RequestOutput, prev_token_at: float | None) -> None:
        m = self.metrics
        n = sum(len(c.token_ids) for c in out.choices)
        s = t.stream
        if n:
            m.on_generation_tokens(n)
            if prev_token_at is None:
                m.on_prompt_tokens(len(s.req.prompt_token_ids))
                m.on_first_token(s.first_token_at - s.created)
            else:
                for _ in range(n):
                    m.on_token((s.last_token_at - prev_token_at) / n)
        if out.finished:
            reason = next((c.finish_reason for c in out.choices), FinishReason.LENGTH)
            m.on_finish(reason, time.monotonic() - s.created, len(s.req.prompt_token_ids),
                        out.usage.completion_tokens if out.usage else 0)
