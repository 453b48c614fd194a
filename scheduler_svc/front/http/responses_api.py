"""``POST /v1/responses``: OpenAI's Responses API, the subset vLLM serves, over the chat path.

A body (responses_api_types.py) becomes the chat request it asks for (responses_api_fields.py)
and runs as a chat request does (app.py's ``chat_requests``: template, validation, structured
outputs; ``_respond``: the engine's stream, disconnects, errors); only its bodies and stream
events are the Responses API's own (responses_api_render.py). What it serves and what it refuses:
README.md, "Responses API".
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pagedserve.engine_api import GenerationRequest
from scheduler_svc.front.api_errors import ApiError
from scheduler_svc.front.guards.request_caps import RequestCaps, check_openai
from scheduler_svc.front.http.responses_api_fields import chat_request
from scheduler_svc.front.http.responses_api_render import ResponseRender
from scheduler_svc.front.http.responses_api_types import ResponsesRequest


class OpenAIFront(Protocol):
    """What this endpoint uses of app.py's front (its bounded read, the chat path, its responses)."""

    chat_template: Any
    limits: Any
    http_limits: Any
    texts: Any

    async def _admit(self, request: Request, kind: type) -> tuple[float, bytes, Any, Any, str | None]: ...

    async def chat_requests(self, req: Any, body_len: int, info: Any, arrival: float, lora: str | None,
                            names: dict[str, str] | None = None) -> tuple[list[GenerationRequest], Any]: ...

    async def _respond(self, request: Request, greqs: list[GenerationRequest], render: Any, stream: bool,
                       events: Any = None) -> Response: ...

# The validator's field names -> the Responses API's (error_responses.from_validation).
NAMES = {"prompt": "input", "prompt_token_ids": "input", "max_tokens": "max_output_tokens",
         "response_format.json_schema": "text.format.schema"}


def routes(front: OpenAIFront) -> list[Route]:
    return [Route("/v1/responses", functools.partial(create, front), methods=["POST"])]


async def create(front: OpenAIFront, request: Request) -> Response:
    arrival, body, req, info, lora = await front._admit(request, ResponsesRequest)
    if front.chat_template is None:  # (before the input is read, as chat checks it)
        raise ApiError(400, f"model {info.model_name!r} has no chat template (chat_template.jinja or "
                            "tokenizer_config.json's chat_template); use /v1/completions",
                       param="input", code="no_chat_template")
    chat, hl = chat_request(req, front.http_limits), front.http_limits
    try:
        # (the counts chat's body had checked as it was decoded: its tools' schemas, by size)
        check_openai(chat, RequestCaps.derive(front.limits, info, hl.max_prompts, hl.max_messages, hl.max_tools))
        greqs, tools = await front.chat_requests(chat, len(body), info, arrival, lora, NAMES)
    except ApiError as e:
        raise _renamed(e) from None
    g = greqs[0]
    render = ResponseRender(f"resp_{g.request_id}", f"msg_{g.request_id}", lora or info.model_name, front.texts,
                            prompt_tokens=len(g.prompt_token_ids), echoed=_echoed(req, g), tools=tools)
    return await front._respond(request, greqs, render, bool(req.stream), events=render.events)


def _renamed(e: ApiError) -> ApiError:
    """The chat path's errors in this API's names: its messages are ``input`` (a template refused
    them), and a tool is flat (``tools[0].name``, not chat's ``tools[0].function.name``)."""
    field, sep, rest = e.message.partition(": ")
    if e.param == "messages" and field.startswith("messages"):
        e.param, field = "input", "input" + field.removeprefix("messages")
    elif e.param in ("tools", "tool_choice"):
        field = field.replace(".function.", ".")
    e.message = field + sep + rest
    return e


def _echoed(req: ResponsesRequest, g: GenerationRequest) -> dict[str, Any]:
    """The request's parameters as a response repeats them: the sampling values it ran with."""
    text = req.text
    fmt = text.format if text is not None and text.format is not None else None
    fmt_body: dict[str, Any] = {"type": "text"}
    if fmt is not None and fmt.type not in (None, "text"):
        fmt_body = {"type": fmt.type}
        if fmt.type == "json_schema":
            fmt_body.update(name=fmt.name, schema=fmt.schema, strict=fmt.strict, description=fmt.description)
    sampling = g.params.sampling
    tools = [{"type": "function", "name": t.name, "description": t.description, "parameters": t.parameters,
              "strict": t.strict} for t in req.function_tools or []]
    return {"instructions": req.instructions, "metadata": req.metadata or {},
            "max_output_tokens": req.max_output_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "text": {"format": fmt_body}, "tools": tools, "tool_choice": req.tool_choice or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False, "previous_response_id": None,
            "reasoning": None, "store": False, "truncation": "disabled", "user": req.user, "background": False}
