"""OpenAI request bodies: typed decoding, then the shared validator's RequestFields.

A body is decoded by msgspec into the Structs below (wrong JSON types fail with the field's
path); what this front adds on top of the gRPC API's fields is checked here (prompt shapes,
messages, fields we refuse rather than ignore), and everything else is left to
``scheduler_svc.validation`` through :class:`RequestFields`, so both fronts apply one set of
rules. Errors are 400s naming the OpenAI field (errors.py).

Accepted beyond OpenAI's own fields, as vLLM does: ``top_k`` (-1 or 0: off), ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``, ``use_beam_search`` (beam width
``n``, best beam first), ``length_penalty``, ``early_stopping``, ``return_token_ids`` (each
choice also carries its token ids) and, for chat, ``add_generation_prompt``. ``user`` and
unknown fields are ignored; fields that would change the output and are not implemented
(``logit_bias``, ``tools``, ``response_format`` other than text, ``suffix``, ``best_of`` > n,
non-text content parts) are refused, never silently dropped.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from scheduler_svc.http.errors import ApiError, bad_field
from scheduler_svc.http.limits import HttpLimits
from scheduler_svc.validation import RequestFields

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Request(msgspec.Struct, kw_only=True):
    """Fields both endpoints share."""

    model: str | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    use_beam_search: bool = False
    length_penalty: float | None = None
    early_stopping: bool = False
    return_token_ids: bool = False
    # Not implemented; refused when they would change the output.
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[str | int | list[int]] | None = None
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None


class ContentPart(msgspec.Struct):
    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None


class ChatRequest(_Request, kw_only=True):
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True


_PATH = re.compile(r"at `\$\.?([^`]*)`")


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Bytes -> ``kind``; malformed JSON or a wrong type is a 400 naming the field's path."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        m = _PATH.search(str(e))
        path = m.group(1) if m else None
        message = _PATH.sub("", str(e)).strip(" -")
        if not path:
            raise ApiError(400, f"request body: {message}", code="invalid_type") from None
        raise bad_field(path, message, code="invalid_type") from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # e.g. [[[[...]]]] in a free-form field: refused, never a crash
        raise ApiError(400, "request body: JSON nested too deeply", code="invalid_json") from None


def completion_fields(req: CompletionRequest, limits: HttpLimits) -> list[RequestFields]:
    """One RequestFields per prompt of the request (a list of prompts is a batch)."""
    if req.echo and req.logprobs is not None:
        raise bad_field("echo", "cannot be combined with logprobs: prompt log-probabilities are not computed")
    if req.suffix:
        raise bad_field("suffix", "is not supported", code="unsupported")
    common = _common(req, req.max_tokens, "max_tokens")
    common["logprobs"] = req.logprobs
    return [RequestFields(prompt=p, **common) if isinstance(p, str) else RequestFields(prompt_token_ids=p, **common)
            for p in prompts(req.prompt, limits)]


def chat_fields(req: ChatRequest) -> RequestFields:
    """The fields of a chat request; its prompt (the rendered messages) is set by the caller."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_field("top_logprobs", "requires logprobs to be true")
    if req.max_completion_tokens is not None:
        common = _common(req, req.max_completion_tokens, "max_completion_tokens")
    else:
        common = _common(req, req.max_tokens, "max_tokens")
    common["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    return RequestFields(**common)


def _common(req: _Request, max_tokens: int | None, max_tokens_name: str) -> dict[str, Any]:
    _refuse_unsupported(req)
    if req.stream_options is not None and not req.stream:
        raise bad_field("stream_options", "is only allowed with stream=true")
    n = _at_least_one("n", req.n)
    fields: dict[str, Any] = dict(
        max_tokens=_at_least_one(max_tokens_name, max_tokens) or 0,  # 0: the validator's default
        n=n or 0, stop=[req.stop] if isinstance(req.stop, str) else req.stop or [],
        stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, early_stopping=req.early_stopping,
        temperature=req.temperature, top_p=req.top_p, top_k=None if req.top_k in (-1, 0) else req.top_k,
        min_p=req.min_p, seed=req.seed, length_penalty=req.length_penalty,
        repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty)
    if req.use_beam_search:  # vLLM: n beams, returned best first; width 1 is greedy
        fields["n"], fields["beam_width"] = 0, (n or 1)
        if (n or 1) == 1:
            fields["temperature"] = 0.0
    return fields


def _refuse_unsupported(req: _Request) -> None:
    if req.logit_bias:
        raise bad_field("logit_bias", "is not supported", code="unsupported")
    if req.tools:
        raise bad_field("tools", "tool calling is not supported", code="unsupported")
    if req.response_format is not None and req.response_format.get("type", "text") != "text":
        raise bad_field("response_format", f"only type 'text' is supported (got {req.response_format.get('type')!r})",
                        code="unsupported")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_field("best_of", f"must equal n when given (got best_of={req.best_of}, n={req.n or 1})",
                        code="unsupported")


def _at_least_one(name: str, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise bad_field(name, f"must be >= 1 (got {value})")
    return value


def prompts(prompt: str | list[str | int | list[int]] | None, limits: HttpLimits) -> list[str | list[int]]:
    """OpenAI's four prompt shapes -> a list of text or token-id prompts."""
    if prompt is None:
        raise bad_field("prompt", "is required", code="missing_required_parameter")
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_field("prompt", "must not be an empty list")
    if all(_is_int(t) for t in prompt):
        return [prompt]  # one prompt of token ids
    if all(isinstance(p, str) for p in prompt):
        batch = prompt
    elif all(isinstance(p, list) for p in prompt):
        for i, p in enumerate(prompt):
            if not p or not all(_is_int(t) for t in p):
                raise bad_field(f"prompt[{i}]", "must be a non-empty list of token ids (integers)")
        batch = prompt
    else:
        raise bad_field("prompt", "must be a string, a list of strings, a list of token ids, "
                                  "or a list of lists of token ids")
    if len(batch) > limits.max_prompts:
        raise bad_field("prompt", f"at most {limits.max_prompts} prompts per request (got {len(batch)})")
    return batch


def _is_int(x: Any) -> bool:
    return type(x) is int  # JSON true/false decode to bool, a subclass of int


def chat_messages(req: ChatRequest, limits: HttpLimits) -> list[dict[str, Any]]:
    """The messages as the plain dicts a chat template reads (text parts joined by newlines)."""
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
        if m.tool_calls:
            raise bad_field(f"messages[{i}].tool_calls", "tool calling is not supported", code="unsupported")
        message: dict[str, Any] = {"role": m.role, "content": _content(i, m.content)}
        if m.name is not None:
            message["name"] = m.name
        out.append(message)
    return out


def _content(i: int, content: str | list[ContentPart] | None) -> str:
    if content is None:
        raise bad_field(f"messages[{i}].content", "is required")
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise bad_field(f"messages[{i}].content[{j}]", f"only text parts are supported (got type {part.type[:40]!r})",
                            code="unsupported")
        texts.append(part.text)
    return "\n".join(texts)
