"""A Responses API body (responses_api_types.py) as the chat body it asks for.

The Responses API is served by the chat route's machinery (template, validation, structured
outputs, streams), so a body becomes a :class:`ChatRequest`: ``instructions`` a system message
first, each ``input`` item a message, ``max_output_tokens`` chat's ``max_completion_tokens``,
``text.format`` chat's ``response_format``, and the sampling fields chat takes beyond OpenAI's
(``SamplingExtras``: seed, stop, vLLM's extensions) as they are. Everything the chat path would name differently is
checked here first, so a 400 names the field the client sent (``input[2].content[0].type``).

There is no response store: ``store`` is accepted (OpenAI's default is true, which the openai
client sends unasked) and nothing is stored; what needs a stored response
(``previous_response_id``, ``conversation``, ``background``) is refused by name, as is whatever
else would change the output and is not served (hosted tools, reasoning, logprobs, ``include``,
``truncation: "auto"``, reusable prompts). Function tools are chat's: ``tools`` in the flat form,
``function_call`` items as an assistant message's ``tool_calls``, ``function_call_output`` items as
``tool`` messages.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec

from scheduler_svc.front.api_errors import bad_field
from scheduler_svc.front.http.limits import HttpLimits
from scheduler_svc.front.http.openai_types import (
    ChatMessage,
    ChatRequest,
    FunctionCall,
    FunctionDef,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    SamplingExtras,
    ToolCall,
    ToolDef,
)
from scheduler_svc.front.http.responses_api_types import (
    FunctionTool,
    InputItem,
    InputPart,
    ResponsesRequest,
    TextFormat,
)

INPUT_ROLES = ("system", "developer", "user", "assistant")
# part type -> the field holding its text; output_text and refusal: an earlier response's message sent back
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
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
    extras = {f.name: getattr(req, f.name) for f in msgspec.structs.fields(SamplingExtras)}
    return ChatRequest(messages=messages, max_completion_tokens=req.max_output_tokens, temperature=req.temperature,
                       top_p=req.top_p, stream=req.stream, user=req.user, response_format=_response_format(req.text),
                       tools=_tools(req.function_tools, limits.max_tools), tool_choice=_tool_choice(req.tool_choice),
                       parallel_tool_calls=req.parallel_tool_calls, **extras)


# Chat's fields whose answer a response has no place for: refused, never run and dropped.
CHAT_ONLY = ("prompt_logprobs", "use_beam_search", "return_token_ids")


def _refuse_unserved(req: ResponsesRequest) -> None:
    for name in CHAT_ONLY:
        value = getattr(req, name)
        if value is not None and value is not False:  # (prompt_logprobs 0 asks for them too; 0 == False)
            raise bad_field(name, "is not served on /v1/responses (a response has no place for it); use "
                                  "/v1/chat/completions", code="unsupported")
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
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        kind = item.type or "message"
        if kind == "message":
            out.append(_message(i, item))
        elif kind == "function_call":  # the calls of one turn: one assistant message, as chat sends them
            call, last = _function_call(i, item), out[-1] if out else None
            if last is not None and last.role == "assistant":
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", tool_calls=[call]))
        elif kind == "function_call_output":
            call_id = _required(i, "call_id", item.call_id)
            output = _required(i, "output", item.output)
            text = output if isinstance(output, str) else "\n".join(
                _text(i, j, p, "output") for j, p in enumerate(output))
            out.append(ChatMessage(role="tool", content=text, tool_call_id=call_id))
        else:
            raise bad_field(f"input[{i}].type", f"must be 'message', 'function_call' or 'function_call_output' "
                                                f"(got {kind[:40]!r})", code="unsupported")
    return out


def _required(i: int, name: str, value: Any) -> Any:
    if value is None:
        raise bad_field(f"input[{i}].{name}", "is required", code="missing_required_parameter")
    return value


def _function_call(i: int, item: InputItem) -> ToolCall:
    call_id, name = _required(i, "call_id", item.call_id), _required(i, "name", item.name)
    arguments = _required(i, "arguments", item.arguments)
    try:
        json.loads(arguments or "{}")
    except ValueError as e:
        raise bad_field(f"input[{i}].arguments", f"is not valid JSON ({e})") from None
    except RecursionError:
        raise bad_field(f"input[{i}].arguments", "is nested too deeply") from None
    return ToolCall(function=FunctionCall(name=name, arguments=arguments), id=call_id)


def _message(i: int, item: InputItem) -> ChatMessage:
    if item.role is None:
        raise bad_field(f"input[{i}].role", "is required", code="missing_required_parameter")
    if item.role not in INPUT_ROLES:
        raise bad_field(f"input[{i}].role", f"must be one of {', '.join(INPUT_ROLES)} (got {item.role[:40]!r})")
    if item.content is None:
        raise bad_field(f"input[{i}].content", "is required", code="missing_required_parameter")
    if isinstance(item.content, str):
        return ChatMessage(role=item.role, content=item.content)
    return ChatMessage(role=item.role, content="\n".join(_text(i, j, p) for j, p in enumerate(item.content)))


def _text(i: int, j: int, part: InputPart, field: str = "content") -> str:
    """A text part's text (joined by newlines, as chat_messages joins chat's text parts)."""
    if part.type not in TEXT_PARTS:
        raise bad_field(f"input[{i}].{field}[{j}].type", f"only text parts ({', '.join(TEXT_PARTS)}) are supported "
                                                         f"(got {str(part.type)[:40]!r})", code="unsupported")
    key = TEXT_PARTS[part.type]
    text = getattr(part, key)
    if text is None:
        raise bad_field(f"input[{i}].{field}[{j}].{key}", f"is required in a part of type {part.type!r}",
                        code="missing_required_parameter")
    return text


def _tools(tools: list[FunctionTool] | None, max_tools: int) -> list[ToolDef] | None:
    """Function tools in chat's form (tool_calls.plan_tools checks them further)."""
    if not tools:
        return None
    if len(tools) > max_tools:
        raise bad_field("tools", f"at most {max_tools} tools per request (got {len(tools)})")
    out = []
    for i, t in enumerate(tools):
        if t.type != "function":
            raise bad_field(f"tools[{i}].type", f"only 'function' tools are supported (got {str(t.type)[:40]!r})",
                            code="unsupported")
        if t.name is None:
            raise bad_field(f"tools[{i}].name", "is required", code="missing_required_parameter")
        out.append(ToolDef(function=FunctionDef(name=t.name, description=t.description, parameters=t.parameters,
                                                strict=t.strict)))
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | NamedToolChoice | None:
    """A string as chat's; ``{"type": "function", "name": ...}`` as chat's named function."""
    if choice is None or isinstance(choice, str):
        return choice
    name = choice.get("name")
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_field("tool_choice", "must be 'none', 'auto', 'required' or {\"type\": \"function\", \"name\": ...} "
                                       f"(got type {str(choice.get('type'))[:40]!r})", code="unsupported")
    return NamedToolChoice(function=NamedFunction(name=name))


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
