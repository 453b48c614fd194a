"""The pagedserve.v1.Generation servicer: Generate, GetModelInfo and GetStats over an engine.

Status codes: the engine's errors as scheduler_svc/front/output/status_codes.py says (the table both fronts
share, by ErrorKind: QUEUE_FULL -> RESOURCE_EXHAUSTED, NO_EXECUTOR -> UNAVAILABLE, FAILED and anything
unexpected -> INTERNAL, this request only); before the engine, here:

    ValidationError -> INVALID_ARGUMENT    no model info, shutting down -> UNAVAILABLE
    a request_id already in flight -> ALREADY_EXISTS

The servicer talks to the engine only through the interface in
docs/ARCHITECTURE.md ("Engine <-> servicer"). When the client cancels or its
deadline passes, the handler is cancelled and the engine's stream is closed
right away (``aclose``), which is the engine's signal to abort the request.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator

import grpc
from tokenizers import Tokenizer

from pagedserve.engine_api import (
    EngineApi,
    EngineStats,
    GenerationRequest,
    ModelInfo,
    RequestOutput,
)
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.front.input.offload import token_ids, validate_off_loop
from scheduler_svc.front.input.request_fields import fields_from_proto
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.front.input.validation import (
    LOGPROBS_MODES,
    ValidationError,
    validate_request,
    validation_work,
)
from scheduler_svc.front.output.status_codes import client_status, no_model_message
from scheduler_svc.telemetry.metrics import Metrics

log = logging.getLogger(__name__)


class _ErrorStatus(Exception):
    """A request ends with a non-OK status (raised inside the servicer only)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


class GenerationServicer(pb_grpc.GenerationServicer):
    """pagedserve.v1.Generation over an engine."""

    def __init__(self, engine: EngineApi, tokenizer: Tokenizer, limits: ServerLimits,
                 metrics: Metrics | None = None, logprobs_mode: str = LOGPROBS_MODES[0]) -> None:
        self._engine = engine
        self._tokenizer = tokenizer
        self._limits = limits
        self._metrics = metrics
        self._logprobs_mode = logprobs_mode  # --logprobs-mode: what every request's log-probs describe
        self._in_flight: set[str] = set()
        self.shutting_down = False
        self._served = False  # a model was known: without one now, the last executor left

    def _model_info(self) -> ModelInfo | None:
        info = self._engine.model_info()
        self._served |= info is not None
        return info

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        # A coroutine writing with context.write (not an async generator): a cancel or deadline
        # raises CancelledError here, inside aclosing, so the engine's stream is closed at once.
        # Aborts happen outside the except blocks: context.abort raises, and an exception raised
        # while handling _ErrorStatus would chain it, its traceback and the request's frames (a
        # multi-megabyte prompt) into a cycle that only a full garbage collection frees.
        error_status = None
        try:
            greq = await self._admit(request, context)
        except _ErrorStatus as e:
            error_status = (e.code, str(e))
        if error_status is not None:
            del request  # (grpc keeps the aborting frames in a cycle until a full collection)
            await self._abort(context, *error_status)
            return
        self._in_flight.add(greq.request_id)
        try:
            async with contextlib.aclosing(self._run(greq)) as responses:
                async for msg in responses:
                    await context.write(msg)
        except _ErrorStatus as e:
            error_status = (e.code, str(e))
        finally:
            self._in_flight.discard(greq.request_id)
        if error_status is not None:
            await self._abort(context, *error_status)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
                           ) -> pb.ModelInfo:
        info = self._model_info()
        if info is None:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, no_model_message(self._served))
        msg = pb.ModelInfo(
            model_name=info.model_name, architecture=info.architecture, max_model_len=info.max_model_len,
            vocab_size=info.vocab_size, block_size=info.block_size, num_executors=info.num_executors,
            limits=self._limits.to_proto(), lora_adapters=list(info.lora_adapters),
        )
        if info.eos_token_ids:
            msg.eos_token_id = info.eos_token_ids[0]
            msg.eos_token_ids.extend(info.eos_token_ids)
        return msg

    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext) -> pb.Stats:
        try:
            return _stats(await self._engine.current_stats())
        except Exception:
            log.exception("engine.stats() failed")
            await self._abort(context, grpc.StatusCode.INTERNAL, "could not collect stats")

    async def _admit(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> GenerationRequest:
        """Validate, tokenize and stamp arrival time and deadline; raise _ErrorStatus."""
        if self.shutting_down:
            raise _ErrorStatus(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        info = self._model_info()
        if info is None:
            raise _ErrorStatus(grpc.StatusCode.UNAVAILABLE, no_model_message(self._served))
        arrival = time.monotonic()
        lora = request.model if request.HasField("model") and request.model != info.model_name else None
        if lora is not None and lora not in info.lora_adapters:
            raise _ErrorStatus(grpc.StatusCode.NOT_FOUND, f"model: {lora[:200]!r} is neither the served model "
                                                         f"{info.model_name!r} nor one of its LoRA adapters")
        try:
            fields = fields_from_proto(request)  # (a long prompt, or a grammar to check: in a worker thread)
            greq = await validate_off_loop(validation_work(fields), validate_request, fields, info, self._limits,
                                           self._tokenize, None, self._logprobs_mode)
        except ValidationError as e:
            raise _ErrorStatus(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None  # (no frames kept: see Generate)
        except Exception as e:  # e.g. the tokenizer failed: a server bug, not the client's
            log.exception("validating a request failed")
            raise _ErrorStatus(grpc.StatusCode.INTERNAL, f"internal error ({type(e).__name__})") from e
        if greq.request_id in self._in_flight:
            raise _ErrorStatus(grpc.StatusCode.ALREADY_EXISTS, f"request_id {greq.request_id!r} is already running")
        greq.arrival_time = arrival
        greq.lora = lora
        remaining = context.time_remaining()  # None: the client set no deadline
        if remaining is not None:
            greq.deadline = time.monotonic() + remaining
        return greq

    async def _run(self, greq: GenerationRequest) -> AsyncIterator[pb.GenerateResponse]:
        """The engine's stream as protobuf, errors mapped to _ErrorStatus; always closes the engine's stream."""
        stream = None
        try:
            stream = self._engine.generate(greq)
            async for out in stream:
                yield _response(out)  # inside the try: a malformed output is INTERNAL too
        except Exception as e:  # the engine's errors, and a malformed output (a bug): status_codes.py
            r = client_status(e, greq.request_id)
            raise _ErrorStatus(grpc.StatusCode[r.grpc_code], r.message) from e
        finally:
            # Cancellation or deadline: closing the stream tells the engine to abort and free blocks.
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    def _tokenize(self, text: str) -> list[int]:
        return token_ids(self._tokenizer, text, True)

    async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        if self._metrics is not None:
            self._metrics.on_rejected(code.name)
        await context.abort(code, message)


def _response(out: RequestOutput) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(request_id=out.request_id)
    if out.prompt_logprobs is not None:
        for lp in out.prompt_logprobs:
            entry = msg.prompt_logprobs.add()
            if lp is not None:
                entry.token_id, entry.logprob = lp.token_id, lp.logprob
                if lp.rank is not None:
                    entry.rank = lp.rank
                for tid, tlp in zip(lp.top_token_ids, lp.top_logprobs, strict=True):
                    entry.top_logprobs.add(token_id=tid, logprob=tlp)
    for c in out.choices:
        choice = msg.choices.add(index=c.index, text=c.text, token_ids=c.token_ids,
                                 finish_reason=int(c.finish_reason))
        if isinstance(c.stop_reason, str):
            choice.stop_string = c.stop_reason
        elif c.stop_reason is not None:
            choice.stop_token_id = c.stop_reason
        for lp in c.logprobs:
            entry = choice.logprobs.add(token_id=lp.token_id, logprob=lp.logprob)
            for tid, tlp in zip(lp.top_token_ids, lp.top_logprobs, strict=True):
                entry.top_logprobs.add(token_id=tid, logprob=tlp)
    if out.usage is not None:
        msg.usage.prompt_tokens = out.usage.prompt_tokens
        msg.usage.completion_tokens = out.usage.completion_tokens
        msg.usage.cached_prompt_tokens = out.usage.cached_prompt_tokens
        msg.usage.spec_proposed_tokens = out.usage.spec_proposed_tokens
        msg.usage.spec_accepted_tokens = out.usage.spec_accepted_tokens
    return msg


def _stats(s: EngineStats) -> pb.Stats:
    msg = pb.Stats(
        num_running=s.num_running, num_waiting=s.num_waiting, num_swapped=s.num_swapped,
        num_preemptions=s.num_preemptions, prefix_cache_query_tokens=s.prefix_cache_query_tokens,
        prefix_cache_hit_tokens=s.prefix_cache_hit_tokens, num_migrations=s.num_migrations,
    )
    for e in s.executors:
        msg.executors.add(
            id=e.id, state=e.state, kv_blocks_total=e.kv_blocks_total, kv_blocks_used=e.kv_blocks_used,
            kv_blocks_cached=e.kv_blocks_cached, kv_blocks_shared=e.kv_blocks_shared,
            cpu_blocks_total=e.cpu_blocks_total, cpu_blocks_used=e.cpu_blocks_used,
            num_running=e.num_running, num_waiting=e.num_waiting, tensor_parallel_size=e.tensor_parallel_size,
        )
    return msg
