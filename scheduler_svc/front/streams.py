"""A front's side of the engine: requests in, their token updates out as detokenized client streams.

:class:`FrontStreams` is what the gRPC servicer and the HTTP front talk to (the ``Engine``
protocol of docs/ARCHITECTURE.md, "Engine <-> servicer"). It admits a request to an engine core
(:class:`CoreApi`: the core in this process, or the cores behind the tier link), and turns the
core's per-step :class:`~scheduler_svc.sched.request.RequestUpdate` batches into each request's
stream: detokenization, stop strings (a choice a stop string ends is finished at the core),
usage, the per-token metrics, and the request's mailbox (``scheduler_svc/front/output/mailbox.py``).

Everything here is per request or per token, so it runs wherever the front runs, never on the
loop that schedules: the core hands a step's updates over once the next plan is on its way,
and this side detokenizes them in chunks that yield to the event loop.

Each request ends exactly once: its last choice finishes (an update), it is abandoned (client
gone, deadline, shutdown: the core is told to abort it) or it fails (an error update); the
metrics count it once: admitted == finished, summed over the reasons.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import time
import uuid
from typing import Protocol

from tokenizers import Tokenizer

from pagedserve.engine_api import (
    EngineError,
    EngineStats,
    ErrorKind,
    FinishReason,
    GenerationRequest,
    ModelInfo,
    RequestUpdate,
)
from pagedserve.kv_blocks import chain_root, hash_blocks
from scheduler_svc.front.output.deltas import DECODE_CASE, RequestStream
from scheduler_svc.front.output.detokenize import standalone_token_texts
from scheduler_svc.front.output.mailbox import Tracked
from scheduler_svc.front.output.stream import OutputStream

CHUNK = 64  # updates streamed between yields to the event loop
DUPLICATE_SUFFIX = 9  # "-" and 8 hex digits: what a request id repeated while in flight gets appended
log = logging.getLogger(__name__)


class CoreApi(Protocol):
    """What a front needs of an engine core: ``EngineCore`` in this process, or the cores behind
    the tier link (``scheduler_svc/front/core_link.py, scheduler_svc/engine/front_link.py``)."""

    def submit(self, req: GenerationRequest, sink: FrontStreams) -> None: ...  # EngineError: QUEUE_FULL, NO_EXECUTOR
    def abort(self, request_id: str) -> None: ...
    def finish_choice(self, request_id: str, index: int) -> None: ...
    def model_info(self) -> ModelInfo | None: ...
    def is_ready(self) -> bool: ...
    def stats(self) -> EngineStats: ...
    def health_problem(self) -> str | None: ...


class FrontStreams:
    def __init__(self, core: CoreApi, tokenizer: Tokenizer, stream_interval: int = 1, metrics=None,
                 id_prefix: str = "") -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.stream_interval = stream_interval
        self.metrics = metrics
        self.id_prefix = id_prefix  # makes this front's ids unique in a core that several fronts share
        # Byte-level BPE spells each byte as one character, SentencePiece a piece as its characters:
        # either way no token covers more characters of a prompt than its longest entry has.
        self.max_token_chars = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=0)
        self.standalone_texts = standalone_token_texts(tokenizer)  # detokenization's table of most tokens
        self.tracked: dict[str, Tracked] = {}  # by the client's request id (unique in this front)
        self.by_core_id: dict[str, Tracked] = {}
        self.closing = False
        self._batches: collections.deque[list[RequestUpdate]] = collections.deque()
        self._wake: asyncio.Future | None = None
        self._pump: asyncio.Task | None = None

    # ------------------------------------------------------------------ the Engine protocol

    def model_info(self) -> ModelInfo | None:
        info = self.core.model_info()
        return None if info is None else dataclasses.replace(info, max_token_chars=self.max_token_chars)

    def is_ready(self) -> bool:
        return not self.closing and self.core.is_ready()

    def stats(self) -> EngineStats:
        return self.core.stats()

    async def update_lora(self, name: str, path: str | None):
        """Load (``path``) or unload (None) a LoRA adapter on the engine core(s); the core's Answer."""
        update = getattr(self.core, "update_lora", None)
        if update is None or not self.core.is_ready():
            raise EngineError(ErrorKind.NO_EXECUTOR, "the engine core is not reachable; try again")
        return await update(name, path)

    async def current_stats(self) -> EngineStats:
        """The engine's stats now (a remote core's last Status is up to a heartbeat old)."""
        current = getattr(self.core, "current_stats", None)
        return await current() if current is not None else self.core.stats()

    def health_problem(self) -> str | None:
        return self.core.health_problem()

    def generate(self, req: GenerationRequest) -> OutputStream:
        """``req``'s outputs, as an async iterator (admitted at its first ``__anext__``).

        Close it (``aclose()``) to stop early: the request is aborted and its blocks freed.
        """
        return OutputStream(req, self._admit, self._abandon)

    async def shutdown(self, grace_s: float) -> None:
        """Stop admitting, let running requests finish for ``grace_s``, abort the rest."""
        self.closing = True
        deadline = time.monotonic() + grace_s
        while self.tracked and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for t in list(self.tracked.values()):
            self._abort(t, notify=True)
        if self._pump is not None:
            self._pump.cancel()

    # ------------------------------------------------------------------ admission and ends

    def _admit(self, req: GenerationRequest) -> Tracked:
        if self.closing:
            raise EngineError(ErrorKind.NO_EXECUTOR, "the server is shutting down")
        if not req.request_id or req.request_id in self.tracked:
            req.request_id = req.request_id + "-" + uuid.uuid4().hex[:DUPLICATE_SUFFIX - 1] if req.request_id \
                else uuid.uuid4().hex
        if not req.arrival_time:
            req.arrival_time = time.monotonic()
        if req.prompt_block_hashes is None and (info := self.core.model_info()) is not None:
            # Hashed once, here: the core's routing and every scheduler's prefix lookup use this chain.
            req.prompt_block_hashes = hash_blocks(chain_root(req.lora, salt=req.cache_salt), req.prompt_token_ids,
                                                  info.block_size)
        p = req.params
        stream = RequestStream(req, self.tokenizer, num_choices=max(p.n, p.beam_width),
                               standalone_texts=self.standalone_texts)
        t = Tracked(stream, self.stream_interval, core_id=self.id_prefix + req.request_id)
        # The core gets a copy under its own id; the stream keeps the client's request (and id).
        self.core.submit(dataclasses.replace(req, request_id=t.core_id), self)  # EngineError: QUEUE_FULL, NO_EXECUTOR
        self.tracked[req.request_id] = t
        self.by_core_id[t.core_id] = t
        if self.metrics:
            self.metrics.on_admitted()
        return t

    def _abandon(self, t: Tracked) -> None:
        """Its consumer went away (stream closed or dropped, client gone, deadline passed)."""
        if not t.ended:
            self._abort(t, notify=False)

    def _abort(self, t: Tracked, notify: bool) -> None:
        self._end(t)
        self.core.abort(t.core_id)
        out = t.stream.abort()
        if notify:
            t.put(out)
        t.ended = True
        if self.metrics:
            self.metrics.on_finish(FinishReason.ABORTED, time.monotonic() - t.stream.created,
                                   len(t.stream.req.prompt_token_ids),
                                   sum(len(v) for v in t.stream.outputs.values()))

    def _fail(self, t: Tracked, exc: Exception) -> None:
        """End ``t`` with ``exc`` (its consumer gets it after the outputs it has not read yet)."""
        self._end(t)
        t.stream.abort()
        t.put_error(exc)
        if self.metrics:
            self.metrics.on_failed()

    def fail_request(self, t: Tracked, exc: Exception) -> None:
        """The engine cannot go on with ``t`` (its core was lost, none can take it): end it."""
        self._fail(t, exc)

    def resumed(self, t: Tracked) -> GenerationRequest:
        """``t``'s request for another engine core (under the same core id)."""
        return dataclasses.replace(t.stream.req, request_id=t.core_id)

    @staticmethod
    def resume_of(t: Tracked) -> tuple[list[list[int]], list[int | None]]:
        """Each choice's tokens streamed so far, and how each that ended ended: where another
        engine core goes on from."""
        stream, n = t.stream, t.stream.num_choices
        outputs = [list(stream.outputs.get(i, [])) for i in range(n)]
        return outputs, [None if (r := stream.finish.get(i)) is None else int(r) for i in range(n)]

    def stream_pending(self) -> None:
        """Stream what the cores handed over and was not streamed yet, now."""
        while self._batches:
            self.stream_now(self._batches.popleft())

    def _end(self, t: Tracked) -> None:
        self.tracked.pop(t.stream.req.request_id, None)
        self.by_core_id.pop(t.core_id, None)

    # ------------------------------------------------------------------ updates from the core

    def deliver(self, updates: list[RequestUpdate]) -> None:
        """One step's updates of this front's requests (the core's UpdateSink): streamed soon, in
        chunks that give way to the event loop, never inside the caller."""
        self._batches.append(updates)
        if self._pump is None:
            self._pump = asyncio.get_running_loop().create_task(self._stream_batches(), name="front-streams")
        w = self._wake
        if w is not None and not w.done():
            w.set_result(None)

    async def _stream_batches(self) -> None:
        batches = self._batches
        while True:
            if not batches:
                self._wake = asyncio.get_running_loop().create_future()
                await self._wake
                self._wake = None
                continue
            updates = batches.popleft()
            for i in range(0, len(updates), CHUNK):
                if i:
                    await asyncio.sleep(0)  # let the event loop (and an engine core on it) through
                try:
                    self.stream_now(updates[i:i + CHUNK])
                except Exception:  # noqa: BLE001  stream_now isolates requests; this is a bug in it
                    log.exception("streaming a step's updates failed")

    def stream_now(self, updates: list[RequestUpdate]) -> None:
        """Detokenize ``updates`` and hand each request its output (the fan-out)."""
        requests, now = self.by_core_id, time.monotonic()
        tokens, itls = 0, []  # metrics of the batch, observed once
        for upd in updates:
            t = requests.get(upd.request_id)
            if t is None or t.ended:
                continue  # ended here meanwhile (aborted): what its last steps brought is dropped
            if upd.error:
                self._fail(t, EngineError(upd.error_kind, upd.error))  # (the kind the core chose, as is)
                continue
            stream = t.stream
            try:
                prev = stream.last_token_at
                out, stopped = stream.apply(upd, now)
                if stopped is DECODE_CASE:  # one token after the first, nothing ended: kept lean
                    tokens += 1
                    itls.append(now - prev)  # type: ignore[operator]
                    t.put(out)
                    continue
                if out.choices or out.finished:
                    t.put(out)
                n = 0
                for c in out.choices:
                    k = len(c.token_ids)
                    n += k
                    if k and prev is not None:  # (a choice's tokens of several steps at once: spread evenly)
                        itls += [(now - prev) / k] * k
                if n:
                    tokens += n
                    if prev is None and self.metrics:
                        self._first_token(stream)
                if out.finished and self.metrics:
                    self._finished(stream, out)
            except Exception:  # noqa: BLE001  one request's failure must not reach the others
                log.exception("streaming request %s failed; failing it alone", stream.req.request_id)
                self.core.abort(t.core_id)
                self._fail(t, EngineError(ErrorKind.FAILED, "internal error while streaming it"))
                continue
            if out.finished:
                self._end(t)
                if stopped and not upd.finished:  # the last choices ended by stop strings: free it now
                    self.core.abort(t.core_id)
            elif stopped:
                for index in stopped:  # the core frees these choices (their next steps are dropped)
                    self.core.finish_choice(t.core_id, index)
        if tokens and self.metrics:
            self.metrics.on_step_tokens(tokens, itls)

    def _first_token(self, stream: RequestStream) -> None:
        self.metrics.on_prompt_tokens(len(stream.req.prompt_token_ids))
        self.metrics.on_first_token(stream.first_token_at - stream.created)

    def _finished(self, stream: RequestStream, out) -> None:
        reason = next((c.finish_reason for c in out.choices), FinishReason.LENGTH)
        self.metrics.on_finish(reason, time.monotonic() - stream.created, len(stream.req.prompt_token_ids),
                               out.usage.completion_tokens if out.usage else 0)

