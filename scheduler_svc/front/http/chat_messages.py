"""A chat request's messages as the plain dicts a chat template reads, tool calls included.

What transformers' ``apply_chat_template`` is given, as vLLM builds it: each message's role,
content (text parts joined by newlines) and name; an assistant message's ``tool_calls`` with
their arguments as a JSON object (the OpenAI API sends them as a JSON string; templates such as
Llama 3.1's write ``arguments | tojson``), and a ``tool`` message's ``tool_call_id``. An
assistant message that only calls tools may have no content (null, as the openai SDK sends a reply
back): its content is then "", as vLLM gives it, since templates concatenate it (ChatML's
``... + message['content'] + ...``) and adding None fails in Jinja.
"""

from __future__ import annotations

import json
from typing import Any

from scheduler_svc.front.api_errors import bad_field
from scheduler_svc.front.http.limits import HttpLimits
from scheduler_svc.front.http.openai_types import CHAT_ROLES, ChatRequest, ContentPart, ToolCall


def chat_messages(req: ChatRequest, limits: HttpLimits) -> list[dict[str, Any]]:
    if req.messages is None:
        raise bad_field("messages", "is required", code="missing_required_parameter")
    if not req.messages:
        raise bad_field("messages", "must not be empty")
    if len(req.messages) > limits.max_messages:
        raise bad_field("messages", f"at most {limits.max_messages} messages per request (got {len(req.messages)})")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise bad_field(f"messages[{i}].role", f"must be one of {', '.join(CHAT_ROLES)} (got {m.role[:40]!r})")
        message: dict[str, Any] = {"role": m.role}
        if m.tool_calls:
            if m.role != "assistant":
                raise bad_field(f"messages[{i}].tool_calls", f"only an assistant message makes tool calls (got {m.role!r})")
            message["content"] = _content(i, m.content) if m.content is not None else ""
            message["tool_calls"] = [_tool_call(i, j, c) for j, c in enumerate(m.tool_calls)]
        else:
            message["content"] = _content(i, m.content)
        if m.name is not None:
            message["name"] = m.name
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        out.append(message)
    return out


MAX_ARGUMENTS_DEPTH = 64  # as a JSON schema's (input/structured.py): deeper fails json.loads or a template's tojson


def _tool_call(i: int, j: int, call: ToolCall) -> dict[str, Any]:
    args, field = call.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments"
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise bad_field(field, f"is not valid JSON ({e})") from None
        except RecursionError:  # [[[[...]]]]: the client's error, never a 500 (which clients retry)
            raise bad_field(field, f"is nested more than {MAX_ARGUMENTS_DEPTH} levels deep") from None
    if _deeper_than(args, MAX_ARGUMENTS_DEPTH):
        raise bad_field(field, f"is nested more than {MAX_ARGUMENTS_DEPTH} levels deep")
    out: dict[str, Any] = {"type": call.type, "function": {"name": call.function.name, "arguments": args}}
    if call.id is not None:
        out["id"] = call.id
    return out


def _deeper_than(node: Any, limit: int) -> bool:
    """Whether ``node`` nests lists and objects more than ``limit`` levels (walked without recursion)."""
    todo = [(node, 0)]
    while todo:
        n, depth = todo.pop()
        children = n.values() if isinstance(n, dict) else n if isinstance(n, list) else None
        if children is None:
            continue
        if depth >= limit:
            return True
        todo.extend((c, depth + 1) for c in children)
    return False


def _content(i: int, content: str | list[ContentPart] | None) -> str:
    if content is None:
        raise bad_field(f"messages[{i}].content", "is required")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        # OpenAI's text parts, the Responses API's name for them, and an assistant's refusal (a
        # history replayed as the API returned it), all read as text, as vLLM reads them
        key = _TEXT_PARTS.get(part.type)
        if key is None:
            raise bad_field(f"messages[{i}].content[{j}]", f"only text parts are supported: {', '.join(_TEXT_PARTS)} "
                                                           f"(got type {part.type[:40]!r})", code="unsupported")
        text = getattr(part, key)
        if text is None:
            raise bad_field(f"messages[{i}].content[{j}].{key}", f"is required in a part of type {part.type!r}",
                            code="missing_required_parameter")
        texts.append(text)
    return "\n".join(texts)


_TEXT_PARTS = {"text": "text", "input_text": "text", "refusal": "refusal"}  # part type -> its text's field
