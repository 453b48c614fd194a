"""Scheduler updates -> client streams: detokenize, stop strings, usage, metrics, mailboxes.

The engine loop calls this after each step's result. With asynchronous
scheduling it is split around the next plan: requests with stop strings are
settled first (a stop string is only visible in text, and finishing the choice
before the next plan is built means it is computed at most once more), then
the next plan goes out, and only then is everything else detokenized and
handed to its consumer, in chunks that yield to the event loop so another
executor's result is not held up behind this one's fan-out.

When the next result arrives before the fan-out is done (the process is short
of CPU: many executors, fast steps), the fan-out stops after the current chunk
and the result goes first; what was not streamed is merged with the next
step's updates (:func:`merge_updates`), so a lagging request gets its tokens in
one message instead of one per step. The fan-out's cost per token falls as
load rises, instead of the executors' next plans waiting behind it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from scheduler_svc.api_types import FinishReason, RequestFailed, RequestOutput
from scheduler_svc.engine_state import ExecutorSlot, Tracked
from scheduler_svc.request import RequestUpdate, SeqUpdate

CHUNK = 64  # updates published between yields to the event loop
log = logging.getLogger(__name__)


class Publisher:
    def __init__(self, metrics, tracked: dict[str, Tracked], fail: Callable[[Tracked, Exception], None]) -> None:
        self.metrics = metrics
        self.tracked = tracked  # the engine's request_id -> Tracked (finished requests leave it here)
        self.fail = fail

    def settle_stops(self, slot: ExecutorSlot, updates: list[RequestUpdate]) -> list[RequestUpdate]:
        """Publish at once what may end by a stop string; return the rest for :meth:`publish`."""
        rest, now = [], []
        for upd in updates:
            t = slot.requests.get(upd.request_id)
            if t is not None and t.stream.req.params.stop:
                now.append(upd)
            else:
                rest.append(upd)
        if now:
            self.publish_now(slot, now)
        return rest

    async def publish(self, slot: ExecutorSlot, updates: list[RequestUpdate],
                      yield_to: Callable[[], bool]) -> list[RequestUpdate]:
        """Stream ``updates`` in chunks; stop once ``yield_to()`` (checked between chunks, after
        at least one, so every request is streamed within a few steps) and return the rest."""
        for i in range(0, len(updates), CHUNK):
            if i:
                await asyncio.sleep(0)  # let other executors' results through
                if yield_to():
                    return updates[i:]
            self.publish_now(slot, updates[i:i + CHUNK])
        return []

    def publish_now(self, slot: ExecutorSlot, updates: list[RequestUpdate]) -> None:
        requests, now = slot.requests, time.monotonic()
        tokens, itls = 0, []  # metrics of the batch, observed once
        for upd in updates:
            t = requests.get(upd.request_id)
            if t is None:
                continue  # aborted while the step ran
            if upd.error:
                requests.pop(upd.request_id, None)
                self.fail(t, RequestFailed(upd.error))  # (a generic message: the detail is in the log)
                continue
            stream = t.stream
            try:
                prev = stream.last_token_at
                if stream.fast is not None and (out := stream.next_token(upd, now)) is not None:
                    tokens += 1  # the decode case (every running request, every step), kept lean
                    itls.append(now - prev)  # type: ignore[operator]  (fast: not the first token)
                    t.put(out)
                    continue
                out, stopped = stream.apply(upd, now)
                for index in stopped:
                    slot.scheduler.finish_sequence(upd.request_id, index, FinishReason.STOP)
                if out.choices or out.finished:
                    t.put(out)
                n = 0
                for c in out.choices:
                    n += len(c.token_ids)
                if n:
                    tokens += n
                    if prev is not None:
                        itls += [(now - prev) / n] * n
                    elif self.metrics:
                        self._first_token(stream)
                if out.finished and self.metrics:
                    self._finished(stream, out)
            except Exception:  # noqa: BLE001  one request's failure must not reach the others
                log.exception("streaming request %s failed; failing it alone", upd.request_id)
                slot.scheduler.abort_request(upd.request_id)
                requests.pop(upd.request_id, None)
                self.fail(t, RequestFailed("internal error while streaming it"))
                continue
            if out.finished:
                requests.pop(upd.request_id, None)
                self.tracked.pop(upd.request_id, None)
        if tokens and self.metrics:
            self.metrics.on_step_tokens(tokens, itls)

    def _first_token(self, stream) -> None:
        self.metrics.on_prompt_tokens(len(stream.req.prompt_token_ids))
        self.metrics.on_first_token(stream.first_token_at - stream.created)

    def _finished(self, stream, out: RequestOutput) -> None:
        reason = next((c.finish_reason for c in out.choices), FinishReason.LENGTH)
        self.metrics.on_finish(reason, time.monotonic() - stream.created, len(stream.req.prompt_token_ids),
                               out.usage.completion_tokens if out.usage else 0)


def merge_updates(older: list[RequestUpdate], newer: list[RequestUpdate]) -> list[RequestUpdate]:
    """``older`` (not streamed yet) followed by ``newer``, one update per request: a request's
    tokens of several steps become one update, in order. Mutates and returns ``older``."""
    if not older:
        return newer
    by_id = {u.request_id: u for u in older}
    for u in newer:
        o = by_id.get(u.request_id)
        if o is None:
            by_id[u.request_id] = u
            older.append(u)
            continue
        o.finished = o.finished or u.finished
        o.prompt_tokens = u.prompt_tokens or o.prompt_tokens
        o.num_cached_prompt_tokens = u.num_cached_prompt_tokens or o.num_cached_prompt_tokens
        o.error = u.error or o.error
        seqs = o.seqs
        for su in u.seqs:  # (this runs when the process is short of CPU: no generators here)
            for at in range(len(seqs)):
                if seqs[at].index == su.index:
                    break
            else:
                seqs.append(su)
                continue
            prev = seqs[at]
            # New lists: a streamed delta keeps its update's token list.
            seqs[at] = SeqUpdate(su.index, prev.new_token_ids + su.new_token_ids,
                                 (prev.logprobs or []) + su.logprobs if su.logprobs else prev.logprobs,
                                 su.finish_reason or prev.finish_reason)
    return older
