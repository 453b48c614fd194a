"""The OpenAI-compatible HTTP front's endpoints: /v1/models, /v1/completions, /v1/chat/completions,
/health and /metrics (the deployment's); /v1/responses is responses_api.py's, vLLM's /tokenize,
/detokenize and /version utility_routes.py's.

It serves the same engine as the gRPC servicer, in the same process and on the same asyncio
loop (serve.py runs uvicorn there), through the same interface (docs/ARCHITECTURE.md,
"Engine <-> servicer") and the same validator: a body is decoded (openai_types.py), turned
into the validator's RequestFields (openai_fields.py), validated into GenerationRequests (one per prompt), and
the engine's streams are rendered as OpenAI JSON or server-sent events (responses.py,
streams.py). Errors get their status in error_responses.py.

asgi_app.build_app assembles the ASGI app around these handlers: its ``middleware`` is where
authentication (API keys) plugs in, and inside it the process's call budget (admission.py).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.requests import Request
from starlette.responses import Response
from tokenizers import Tokenizer

from pagedserve.engine_api import EngineApi, EngineError, ErrorKind, GenerationRequest, ModelInfo
from scheduler_svc.front.api_errors import ApiError, bad_field
from scheduler_svc.front.guards.request_caps import RequestCaps
from scheduler_svc.front.http import streams
from scheduler_svc.front.http.body_parser import BodyParser, read_body
from scheduler_svc.front.http.chat_messages import chat_messages
from scheduler_svc.front.http.chat_template import ChatTemplate, ChatTemplateError, template_error
from scheduler_svc.front.http.error_responses import from_engine, from_validation, no_executor
from scheduler_svc.front.http.limits import HttpLimits, body_cap
from scheduler_svc.front.http.openai_fields import chat_fields, completion_fields, echo_only, is_batch
from scheduler_svc.front.http.openai_types import ChatRequest, CompletionRequest, decode
from scheduler_svc.front.http.responses import ChatRender, CompletionRender, TokenTexts, _Render
from scheduler_svc.front.input.offload import THREAD_CHARS, token_ids, validate_off_loop
from scheduler_svc.front.input.request_fields import RequestFields
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.front.input.validation import (
    LOGPROBS_MODES,
    ValidationError,
    validate_request,
    validation_work,
)
from scheduler_svc.front.output.status_codes import client_status
from scheduler_svc.front.tool_calls import ToolCallOptions, ToolPlan, plan_tools
from scheduler_svc.telemetry.metrics import Metrics

# A stream's bytes from its first output, the rest, and the maker of an error's body (_respond).
EventSource = Callable[[streams.Tagged, AsyncIterator[streams.Tagged], Callable[[BaseException], dict[str, Any]]],
                       AsyncIterator[bytes]]
NO_AUTO_TOOLS = ToolCallOptions()  # tool_choice auto rejected; required and named functions served
# The validator's field names -> the OpenAI fields a client sent (errors.from_validation).
_STRUCTURED_NAMES = {"response_format.json_schema": "response_format.json_schema.schema",
                     "structured_outputs.json_schema": "structured_outputs.json",
                     "guided_json.json_schema": "guided_json", "guided_regex.regex": "guided_regex",
                     "guided_choice.choice": "guided_choice", "guided_grammar.grammar": "guided_grammar",
                     "tool_choice.json_schema": "tools"}
COMPLETION_NAMES = {"prompt_token_ids": "prompt", "beam_width": "n", **_STRUCTURED_NAMES}
CHAT_NAMES = {"prompt": "messages", "prompt_token_ids": "messages", "beam_width": "n", "logprobs": "top_logprobs",
              **_STRUCTURED_NAMES}


class OpenAIFront:
    """The endpoint handlers over an engine (Starlette request -> response)."""

    def __init__(self, engine: EngineApi, tokenizer: Tokenizer, chat_template: ChatTemplate | None,
                 limits: ServerLimits, http_limits: HttpLimits, metrics: Metrics | None = None,
                 tool_options: ToolCallOptions = NO_AUTO_TOOLS, logprobs_mode: str = LOGPROBS_MODES[0],
                 lora_updates: bool = False) -> None:
        """``lora_updates``: serve the runtime LoRA endpoints (lora_routes.py)."""
        self.engine, self.tokenizer, self.chat_template = engine, tokenizer, chat_template
        self.lora_updates = lora_updates
        self.limits, self.http_limits, self.metrics = limits, http_limits, metrics
        self.tool_options, self.logprobs_mode = tool_options, logprobs_mode
        self.special_tokens = frozenset(t.content for t in tokenizer.get_added_tokens_decoder().values() if t.special)
        self.texts = TokenTexts(tokenizer)
        self.shutting_down = False
        # The model last served: without one now, the last executor left (error_responses.no_executor);
        # /v1/models still lists it meanwhile (a client's model picker across an executors' restart).
        self.last_info: ModelInfo | None = None
        self.parser = BodyParser()  # JSON bodies: large ones in the parse worker (body_parser.py)
        self.created = int(time.time())
        # The deployment's metrics (a front asks its engine core, which sums every front's): None in a
        # process that has the whole engine, whose own registry is then served.
        self.metrics_text = None

    # ------------------------------------------------------------------ endpoints
    async def health(self, request: Request) -> Response:
        """200 once an executor is ready, 503 before and during shutdown (not counted as a rejection)."""
        if self.shutting_down:
            return json_response(ApiError(503, "the server is shutting down", code="shutting_down").body(), 503)
        if not self.engine.is_ready():
            return json_response(ApiError(503, "no executor is ready", code="no_executor").body(), 503)
        return json_response({"status": "ok"})

    async def prometheus(self, request: Request) -> Response:
        """/metrics on the API port: the deployment's metrics, whichever front answers (the
        Gateway API Inference Extension's endpoint picker scrapes the port it routes to)."""
        if self.metrics_text is not None:
            try:
                text = await self.metrics_text()
            except (TimeoutError, asyncio.TimeoutError):
                return json_response(ApiError(503, "the engine core did not answer", code="no_executor").body(), 503)
            body = text.encode()
        else:
            body = generate_latest(self.metrics.registry) if self.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    async def models(self, request: Request) -> Response:
        """The model and its LoRA adapters (each with the model as its ``parent``, as vLLM lists them):
        the last served while no executor is connected (503 before any was, or shutting down)."""
        info = self.engine.model_info() or (self.last_info if not self.shutting_down else None) or self._info()
        base = {"id": info.model_name, "object": "model", "created": self.created, "owned_by": "pagedserve",
                "root": info.model_name, "parent": None, "max_model_len": info.max_model_len}
        cards = [base] + [{**base, "id": name, "root": name, "parent": info.model_name} for name in info.lora_adapters]
        wanted = request.path_params.get("model")
        if wanted is None:
            return json_response({"object": "list", "data": cards})
        for card in cards:
            if card["id"] == wanted:
                return json_response(card)
        raise _unknown_model(wanted)

    async def completions(self, request: Request) -> Response:
        arrival, body, req, info, lora = await self._admit(request, CompletionRequest)
        # A large body's prompts are read in a worker thread (64 prompts of ids: 100 ms of Python).
        fields = completion_fields(req, self.http_limits) if len(body) <= THREAD_CHARS else None
        work = len(body) if fields is None else _tokenizer_work(fields, req.echo)
        greqs, echo = await validate_off_loop(work, self._completion_requests, req, fields, info)
        _stamp(greqs, arrival, req.skip_special_tokens, lora)
        render = CompletionRender(f"cmpl-{greqs[0].request_id}", lora or info.model_name, _choices(greqs[0]), len(greqs),
                                  self.texts, return_token_ids=req.return_token_ids, echo=echo,
                                  prompt_ids=[g.prompt_token_ids for g in greqs] if echo or req.return_token_ids else None,
                                  skip_special_tokens=greqs[0].params.skip_special_tokens,
                                  echo_only=echo_only(req), want_logprobs=req.logprobs is not None,
                                  **_usage_options(req, greqs))
        return await self._respond(request, greqs, render, req.stream)

    async def chat(self, request: Request) -> Response:
        arrival, body, req, info, lora = await self._admit(request, ChatRequest)
        greqs, tools = await self.chat_requests(req, len(body), info, arrival, lora)
        render = ChatRender(f"chatcmpl-{greqs[0].request_id}", lora or info.model_name, _choices(greqs[0]), 1,
                            self.texts, return_token_ids=req.return_token_ids, tools=tools,
                            prompt_ids=[greqs[0].prompt_token_ids] if req.return_token_ids else None,
                            **_usage_options(req, greqs))
        return await self._respond(request, greqs, render, req.stream)

    async def chat_requests(self, req: ChatRequest, body_len: int, info: ModelInfo, arrival: float,
                            lora: str | None, names: dict[str, str] | None = None
                            ) -> tuple[list[GenerationRequest], ToolPlan]:
        """A chat body's engine request (one) and its tool plan, whichever API it came by (the
        Responses API's too, responses_api.py); ``names``: the validator's fields as that API names them."""
        messages = chat_messages(req, self.http_limits)
        fields = chat_fields(req)
        tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, self.tool_options, self.special_tokens)
        if tools.structured is not None:
            if fields.structured is not None:
                raise bad_field(fields.structured.field, "cannot be combined with tool_choice "
                                                         f"{req.tool_choice!r}: one grammar per request")
            fields.structured = tools.structured
        if self.chat_template is None:
            raise ApiError(400, f"model {info.model_name!r} has no chat template (chat_template.jinja or "
                                "tokenizer_config.json's chat_template); use /v1/completions",
                           param="messages", code="no_chat_template")
        if names is None:
            names = dict(CHAT_NAMES, max_tokens="max_completion_tokens" if req.max_completion_tokens is not None
                         else "max_tokens")
        work = body_len + validation_work(RequestFields(structured=fields.structured))
        greqs = await validate_off_loop(work, self._chat_request, fields, messages, req, tools, info, names)
        _stamp(greqs, arrival, req.skip_special_tokens and tools.skip_special_tokens, lora)
        return greqs, tools

    # ------------------------------------------------------------------ admission
    def body_cap(self) -> int:
        """The largest body read now (limits.body_cap): derived from the model once one is known;
        before, only the allowance (such a request gets 503 unread anyway)."""
        info = self.engine.model_info()
        return body_cap(self.http_limits, info.max_model_len if info is not None else 0,
                        self.limits.max_in_flight_bytes)

    async def _admit(self, request: Request, kind: type) -> tuple[float, bytes, Any, ModelInfo, str | None]:
        """(arrival time, body, decoded body, model, LoRA adapter or None): the bounded read, the JSON,
        the model named.
        No body is read before a model is known, nor one over the cap (413 from its length), nor a
        large one while the parse worker's queue is full (503)."""
        arrival = time.monotonic()
        info, cap, hl = self._info(), self.body_cap(), self.http_limits
        length = request.headers.get("content-length", "")
        if length.isdigit() and int(length) <= cap:  # (over it, or malformed: read_body's 413)
            self.parser.check_room(int(length))  # 503 unread when the parse worker's queue is full
        body = await read_body(request, cap, hl.body_timeout_s)
        req = await self.parser.decode(body, kind, RequestCaps.derive(self.limits, info, hl.max_prompts,
                                                                      hl.max_messages, hl.max_tools))
        return (arrival, body, req, *self._model(req.model))

    async def small_body(self, request: Request, kind: type, limit: int) -> Any:
        """A small JSON body (an administrative call) read within ``limit`` bytes, as ``kind`` (its 400s)."""
        return decode(await read_body(request, limit, self.http_limits.body_timeout_s), kind)

    def _info(self) -> ModelInfo:
        if self.shutting_down:
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        info = self.engine.model_info()
        if info is None:
            raise no_executor(self.last_info is not None)
        self.last_info = info
        return info

    def _model(self, name: str | None) -> tuple[ModelInfo, str | None]:
        """The model a request's ``model`` field names: the served one (no LoRA; also when empty, as
        vLLM reads it) or one of its adapters."""
        info = self._info()
        if not name or name == info.model_name:
            return info, None
        if name in info.lora_adapters:
            return info, name
        raise _unknown_model(name)

    # Validating (tokenizing, rendering) a large body runs in a worker thread (validate_off_loop),
    # as on the gRPC front; so does decoding the prompts an echo repeats.
    def _completion_requests(self, req: CompletionRequest, fields: list[RequestFields] | None, info: ModelInfo
                             ) -> tuple[list[GenerationRequest], list[str] | None]:
        fields = fields if fields is not None else completion_fields(req, self.http_limits)
        greqs = self._validate(fields, info, COMPLETION_NAMES, False, req.add_special_tokens, batched=is_batch(req.prompt))
        return greqs, [self._prompt_text(f, g) for f, g in zip(fields, greqs, strict=True)] if req.echo else None

    def _chat_request(self, fields: RequestFields, messages: list[dict[str, Any]], req: ChatRequest,
                      tools: ToolPlan, info: ModelInfo, names: dict[str, str]) -> list[GenerationRequest]:
        assert self.chat_template is not None  # checked by chat()
        try:
            fields.prompt = self.chat_template.render(messages, req.add_generation_prompt, tools.tools,
                                                      req.continue_final_message, req.chat_template_kwargs,
                                                      req.documents)
        except ChatTemplateError as e:
            raise template_error(e) from e
        return self._validate([fields], info, names, True, req.add_special_tokens)

    def _validate(self, batch: list[RequestFields], info: ModelInfo, names: dict[str, str],
                  chat: bool, add_special_tokens: bool, batched: bool = False) -> list[GenerationRequest]:
        """Completions default to ServerLimits.default_max_tokens, and by default add the tokenizer's
        special tokens (BOS) as gRPC does; a chat prompt by default has its special tokens from the
        template alone, and may use the whole context left (OpenAI's chat default).
        ``add_special_tokens``: the request's (vLLM's field). ``batched``: errors name prompt[i]."""
        tokenize = self._tokenize if add_special_tokens else self._tokenize_plain
        default_max_tokens = info.max_model_len if chat else None
        out = []
        for i, fields in enumerate(batch):
            fields.request_id = f"{out[0].request_id}-{i}" if out else ""
            try:
                out.append(validate_request(fields, info, self.limits, tokenize, default_max_tokens,
                                            self.logprobs_mode))
            except ValidationError as e:
                indexed = {"prompt": f"prompt[{i}]", "prompt_token_ids": f"prompt[{i}]"} if batched else {}
                raise from_validation(e, {**names, **indexed}) from None
        return out

    def _tokenize(self, text: str) -> list[int]:
        return token_ids(self.tokenizer, text, True)

    def _tokenize_plain(self, text: str) -> list[int]:
        return token_ids(self.tokenizer, text, False)

    def _prompt_text(self, f: RequestFields, g: GenerationRequest) -> str:
        """The prompt an echo repeats: the text sent, or what the model read of it when it was cut
        (truncate_prompt_tokens), so that the prompt's log-prob offsets fall in the echoed text."""
        cut = f.truncate_prompt_tokens not in (None, -1)
        return f.prompt if f.prompt is not None and not cut else self.tokenizer.decode(list(g.prompt_token_ids))

    # ------------------------------------------------------------------ responses
    async def _respond(self, request: Request, greqs: list[GenerationRequest], render: _Render,
                       stream: bool, events: EventSource | None = None) -> Response:
        """``events``: a stream's bytes from (first output, the rest, the error body maker), when not
        chat's and completions' (``data:`` chunks, then ``[DONE]``)."""
        engine_streams = [self.engine.generate(g) for g in greqs]
        outputs = streams.single(engine_streams[0]) if len(greqs) == 1 else streams.merge(engine_streams)
        try:  # errors before the first output (queue full, no executor) still get their status
            first = await streams.until_disconnect(request, _next(outputs))
            if stream:
                if events is not None:
                    return streams.EventStreamResponse(events(first, outputs, self._stream_error))
                return streams.EventStreamResponse(streams.sse_events(
                    first, outputs, render.chunk, lambda: render.usage_chunk() if render.include_usage else None,
                    self._stream_error))
            render.add(*first)
            await streams.until_disconnect(request, _drain(outputs, render))
            return json_response(render.response())
        except streams.ClientGone:
            await outputs.aclose()
            self._count("CANCELLED")
            return Response(status_code=499)  # nobody reads it (nginx's "client closed request")
        except BaseException as e:
            await outputs.aclose()
            if isinstance(e, Exception):
                raise engine_error(e, greqs[0].request_id) from e
            raise

    def _stream_error(self, e: BaseException) -> dict[str, Any]:
        err = engine_error(e, "stream")
        self._count(err.grpc_code)
        return err.body()

    def _count(self, code: str) -> None:
        if self.metrics is not None:
            self.metrics.on_rejected(code)


async def _next(outputs: AsyncIterator[streams.Tagged]) -> streams.Tagged:
    try:
        return await anext(outputs)
    except StopAsyncIteration:
        raise EngineError(ErrorKind.FAILED, "the engine ended the request without output") from None


async def _drain(outputs: AsyncIterator[streams.Tagged], render: _Render) -> None:
    async for prompt, out in outputs:
        render.add(prompt, out)


def engine_error(e: Exception, request_id: str) -> ApiError:
    """The engine's errors (and anything unexpected) as HTTP statuses (output/status_codes.py)."""
    if isinstance(e, ApiError):
        return e
    return from_engine(client_status(e, request_id))


def _unknown_model(name: str) -> ApiError:
    return ApiError(404, f"The model {name[:200]!r} does not exist", param="model", code="model_not_found")


def _tokenizer_work(fields: list[RequestFields], echo: bool) -> int:
    """How much a small completions request makes the tokenizer do, in characters or ids: the text
    prompts to encode, the token-id prompts an echo decodes; past the threshold when a grammar must
    be checked (validation_work). (A large body goes to a worker thread whatever it holds.)"""
    return sum(validation_work(f) + (len(f.prompt_token_ids) if echo and f.prompt is None else 0) for f in fields)


def _stamp(greqs: list[GenerationRequest], arrival: float, skip_special_tokens: bool, lora: str | None) -> None:
    """Each request's queue time starts when its HTTP request arrived, before the body was read; each
    runs under the LoRA adapter its ``model`` field named."""
    for g in greqs:
        g.arrival_time = arrival
        g.params.skip_special_tokens = skip_special_tokens
        g.lora = lora


def _choices(g: GenerationRequest) -> int:
    return max(g.params.n, g.params.beam_width)  # beam search returns beam_width choices


def _usage_options(req: CompletionRequest | ChatRequest, greqs: list[GenerationRequest]) -> dict[str, Any]:
    """stream_options (continuous_usage_stats only with include_usage, as vLLM) and the usage's start."""
    so = req.stream_options
    return {"include_usage": so is not None and so.include_usage,
            "continuous_usage": so is not None and so.include_usage and so.continuous_usage_stats,
            "prompt_tokens": [len(g.prompt_token_ids) for g in greqs]}


def json_response(body: Any, status: int = 200) -> Response:
    return Response(streams.json_bytes(body), status_code=status, media_type="application/json")
