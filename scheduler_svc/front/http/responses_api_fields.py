"""A Responses API body (responses_api_types.py) as the chat body it asks for.

The Responses API is served by the chat route's machinery (template, validation, structured
outputs, streams), so a body becomes a :class:`ChatRequest`: ``instructions`` a system message
first, each ``input`` item a message, ``max_output_tokens`` chat's ``max_completion_tokens``,
``text.format`` chat's ``response_format``. Everything the chat path would name differently is
checked here first, so a 400 names the field the client sent (``input[2].content[0].type``).

There is no response store: ``store`` is accepted (OpenAI's default is true, which the openai
client sends unasked) and nothing is stored; what needs a stored response
(``previous_response_id``, ``conversation``, ``background``) is refused by name, as is whatever
else would change the output and is not served (function tools, reasoning, logprobs, ``include``,
``truncation: "auto"``, reusable prompts).
"""

from __future__ import annotations

from typing import Any

from scheduler_svc.front.api_errors import bad_field
from scheduler_svc.front.http.limits import HttpLimits
from scheduler_svc.front.http.openai_types import ChatMessage, ChatRequest, JsonSchemaFormat, ResponseFormat
from scheduler_svc.front.http.responses_api_types import InputItem, InputPart, ResponsesRequest, TextFormat

INPUT_ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text")  # output_text: an earlier response's message sent back
# OpenAI's bounds on metadata (echoed back, so held to them: a client cannot make a response huge).
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512


def chat_request(req: ResponsesRequest, limits: HttpLimits) -> ChatRequest:
    """The chat request ``req`` asks for (400s naming the Responses API's fields)."""
    _refuse_unserved(req)
    _check_metadata(req.metadata)
    if req.max_output_tokens is not None and req.max_output_tokens < 1:
        raise bad_field("max_output_tokens", f"must be >= 1 (got {req.max_output_tokens})")
    messages = [ChatMessage(role="system", content=req.instructions)] if req.instructions is not None else []
    messages += _input_messages(req.input, limits.max_messages - len(messages))
    return ChatRequest(messages=messages, max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
                       top_p=req.top_p, stream=req.stream, user=req.user, response_format=_response_format(req.text))


def _refuse_unserved(req: ResponsesRequest) -> None:
    if req.previous_response_id is not None:
        raise bad_field("previous_response_id", "is not supported: this server stores no responses; send the "
                                                "whole conversation in input", code="unsupported")
    if req.conversation is not None:
        raise bad_field("conversation", "is not supported: this server stores no conversations; send the whole "
                                        "conversation in input", code="unsupported")
    if req.background:
        raise bad_field("background", "is not supported: this server stores no responses to poll", code="unsupported")
    if req.prompt is not None:
        raise bad_field("prompt", "is not supported (no stored prompt templates); send instructions and input",
                        code="unsupported")
    if req.include:
        raise bad_field("include", f"is not supported: the output is the message text alone (got "
                                   f"{str(req.include[0])[:60]!r})", code="unsupported")
    r = req.reasoning  # ({"effort": null} asks for nothing)
    if r is not None and (not isinstance(r, dict) or any(v is not None for v in r.values())):
        raise bad_field("reasoning", "is not supported by this server", code="unsupported")
    if req.top_logprobs:
        raise bad_field("top_logprobs", "is not supported on /v1/responses; use /v1/chat/completions",
                        code="unsupported")
    if req.truncation not in (None, "disabled"):
        raise bad_field("truncation", f"only 'disabled' is supported: a prompt that does not fit is refused "
                                      f"(got {req.truncation[:40]!r})", code="unsupported")
    if req.function_tools:
        raise bad_field("tools", "are not supported on /v1/responses by this server (no function calls in its "
                                 "output); use /v1/chat/completions for tool calls", code="unsupported")
    if req.tool_choice not in (None, "none", "auto"):
        raise bad_field("tool_choice", "must be 'none' or 'auto' (tools are not supported on /v1/responses)",
                        code="unsupported")


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if not metadata:
        return
    if len(metadata) > METADATA_PAIRS:
        raise bad_field("metadata", f"at most {METADATA_PAIRS} pairs (got {len(metadata)})")
    for key, value in metadata.items():
        if len(key) > METADATA_KEY_CHARS:
            raise bad_field("metadata", f"keys are at most {METADATA_KEY_CHARS} characters (got {len(key)}: "
                                        f"{key[:40]!r}...)")
        if len(value) > METADATA_VALUE_CHARS:
            raise bad_field(f"metadata.{key}", f"at most {METADATA_VALUE_CHARS} characters (got {len(value)})")


def _input_messages(items: str | list[InputItem] | None, room: int) -> list[ChatMessage]:
    if items is None:
        raise bad_field("input", "is required", code="missing_required_parameter")
    if isinstance(items, str):
        return [ChatMessage(role="user", content=items)]
    if not items:
        raise bad_field("input", "must not be empty")
    if len(items) > room:
        raise bad_field("input", f"at most {room} items per request (got {len(items)})")
    return [_message(i, item) for i, item in enumerate(items)]


def _message(i: int, item: InputItem) -> ChatMessage:
    if item.type not in (None, "message"):
        raise bad_field(f"input[{i}].type", f"only 'message' items are supported (got {item.type[:40]!r})",
                        code="unsupported")
    if item.role is None:
        raise bad_field(f"input[{i}].role", "is required", code="missing_required_parameter")
    if item.role not in INPUT_ROLES:
        raise bad_field(f"input[{i}].role", f"must be one of {', '.join(INPUT_ROLES)} (got {item.role[:40]!r})")
    if item.content is None:
        raise bad_field(f"input[{i}].content", "is required", code="missing_required_parameter")
    if isinstance(item.content, str):
        return ChatMessage(role=item.role, content=item.content)
    return ChatMessage(role=item.role, content="\n".join(_text(i, j, p) for j, p in enumerate(item.content)))


def _text(i: int, j: int, part: InputPart) -> str:
    """A text part's text (joined by newlines, as chat_messages joins chat's text parts)."""
    if part.type not in TEXT_PARTS:
        raise bad_field(f"input[{i}].content[{j}].type", f"only text parts ({', '.join(TEXT_PARTS)}) are supported "
                                                         f"(got {str(part.type)[:40]!r})", code="unsupported")
    if part.text is None:
        raise bad_field(f"input[{i}].content[{j}].text", f"is required in a part of type {part.type!r}",
                        code="missing_required_parameter")
    return part.text


def _response_format(text: Any) -> ResponseFormat | None:
    fmt: TextFormat | None = text.format if text is not None else None
    if fmt is None or fmt.type in (None, "text"):
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.type == "json_schema":
        if fmt.schema is None:
            raise bad_field("text.format.schema", "is required with type 'json_schema'",
                            code="missing_required_parameter")
        return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(
            name=fmt.name, schema=fmt.schema, strict=fmt.strict, description=fmt.description))
    raise bad_field("text.format.type", f"must be 'text', 'json_object' or 'json_schema' (got {fmt.type[:40]!r})",
                    code="unsupported")
