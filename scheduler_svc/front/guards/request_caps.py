"""Counts inside one request, bounded by what the served model can use, checked before the front's
process builds the request's objects.

A body within the byte cap (request_size.py) can still hold hundreds of thousands of items: 3 MiB
of JSON is 786,000 one-letter stop strings or 250,000 logit_bias entries, and building them takes
40-50 ms of the event loop whatever is then refused. A large request is therefore decoded and
checked against these caps in the parse worker (input/parse_worker.py), a process of its own, and
only a request within them is rebuilt in the front. The validator (input/validation.py) still
checks every request afterwards; these caps use its limits and its wording, so a refusal reads
the same whichever path found it.

| cap | value |
|---|---|
| ids in one prompt | fewer than ``max_model_len`` (one token is left to generate) |
| prompts in one completions request | ``--http-max-prompts`` (64) |
| chat messages | ``--http-max-messages`` (1024) |
| tools | ``--http-max-tools`` (128, OpenAI's own limit) |
| stop strings as sent, their length | 4 x ``--max-stop-strings`` (16; duplicates collapse, then the validator counts them), ``--max-stop-string-len`` (256 characters) |
| stop token ids as sent | 4 x ``--max-stop-token-ids`` (64; as stop strings) |
| logit_bias entries | ``--max-logit-bias`` (1024), at most the vocabulary |
| a structured-output spec or a tool's parameters | ``--max-structured-chars`` (65,536 characters) |
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import msgspec

from pagedserve.engine_api import ModelInfo
from pagedserve.request_bounds import CONTEXT_LENGTH_EXCEEDED, context_exceeded
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.wire.protocol import MAX_LOGIT_BIAS, MAX_STRUCTURED_CHARS
from scheduler_svc.front.api_errors import ApiError, bad_field
from scheduler_svc.front.input.server_limits import ServerLimits, raw_list_problem


@dataclass(frozen=True, slots=True)
class RequestCaps:
    max_model_len: int
    prompts: int
    messages: int
    tools: int
    stop_strings: int
    stop_string_chars: int
    stop_token_ids: int
    logit_bias: int
    structured_chars: int

    @classmethod
    def derive(cls, limits: ServerLimits, model: ModelInfo, prompts: int, messages: int, tools: int) -> RequestCaps:
        return cls(model.max_model_len, prompts, messages, tools, limits.max_stop_strings, limits.max_stop_string_len,
                   limits.max_stop_token_ids, min(limits.max_logit_bias, MAX_LOGIT_BIAS, model.vocab_size),
                   min(limits.max_structured_chars, MAX_STRUCTURED_CHARS))

    def to_wire(self) -> list[int]:
        return list(dataclasses.astuple(self))

    @classmethod
    def from_wire(cls, values: list[int]) -> RequestCaps:
        return cls(*values)


# ---------------------------------------------------------------------------------- OpenAI bodies
def check_openai(req: Any, caps: RequestCaps) -> None:
    """ApiError 400 naming the first field of a decoded body (completions, chat, /tokenize,
    /detokenize) over its cap; fields its kind lacks are skipped."""
    prompt = getattr(req, "prompt", None)
    if isinstance(prompt, list):
        # a prompt cut to its last k tokens is held to the context once cut (validation.py); the
        # body's cap bounds it until then
        _check_prompts(prompt, caps, cut=getattr(req, "truncate_prompt_tokens", None) not in (None, -1))
    tokens = getattr(req, "tokens", None)
    if tokens is not None and len(tokens) > caps.max_model_len:
        raise bad_field("tokens", f"at most max_model_len={caps.max_model_len} ids (got {len(tokens)})")
    messages = getattr(req, "messages", None)
    if messages is not None and len(messages) > caps.messages:
        raise bad_field("messages", f"at most {caps.messages} messages per request (got {len(messages)})")
    tools = getattr(req, "tools", None) or []
    if len(tools) > caps.tools:
        raise bad_field("tools", f"at most {caps.tools} tools per request (got {len(tools)})")
    for i, tool in enumerate(tools):
        _bounded(f"tools[{i}].function.parameters", tool.function.parameters, caps.structured_chars)
    stop, stop_ids, bias = (getattr(req, name, None) for name in ("stop", "stop_token_ids", "logit_bias"))
    if isinstance(stop, list):
        _check_stop(stop, caps)
    if stop_ids is not None and (problem := raw_list_problem(len(stop_ids), caps.stop_token_ids)) is not None:
        raise bad_field("stop_token_ids", problem)
    if bias is not None and len(bias) > caps.logit_bias:
        raise bad_field("logit_bias", f"at most {caps.logit_bias} entries (got {len(bias)})")
    for field, spec in _structured_specs(req):
        _bounded(field, spec, caps.structured_chars)


def _check_prompts(prompt: list, caps: RequestCaps, cut: bool) -> None:
    if prompt and not isinstance(prompt[0], (str, list)):  # one prompt of token ids
        if not cut:
            _check_ids("prompt", len(prompt), caps)
        return
    if len(prompt) > caps.prompts:
        raise bad_field("prompt", f"at most {caps.prompts} prompts per request (got {len(prompt)})")
    for i, p in enumerate(prompt):
        if isinstance(p, list) and not cut:
            _check_ids(f"prompt[{i}]", len(p), caps)


def _check_ids(field: str, n: int, caps: RequestCaps) -> None:
    if n >= caps.max_model_len:
        raise bad_field(field, context_exceeded(caps.max_model_len, n), code=CONTEXT_LENGTH_EXCEEDED)


def _check_stop(stop: list[str], caps: RequestCaps) -> None:
    if (problem := raw_list_problem(len(stop), caps.stop_strings)) is not None:
        raise bad_field("stop", problem)
    for i, s in enumerate(stop):
        if len(s) > caps.stop_string_chars:
            raise bad_field(f"stop[{i}]", f"must be at most {caps.stop_string_chars} characters (got {len(s)})")


def _structured_specs(req: Any) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.json_schema is not None:
        out.append(("response_format.json_schema.schema", rf.json_schema.schema))
    so = getattr(req, "structured_outputs", None)
    if so is not None:
        out += [(f"structured_outputs.{name}", getattr(so, name)) for name in ("json", "regex", "choice", "grammar")]
    out += [(name, getattr(req, name, None))
            for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")]
    return [(field, spec) for field, spec in out if spec is not None]


def _bounded(field: str, spec: Any, limit: int) -> None:
    """A spec's size in characters: a string's own, anything else's as compact JSON."""
    if spec is None:
        return
    n = len(spec) if isinstance(spec, str) else len(msgspec.json.encode(spec).decode())
    if n > limit:
        raise bad_field(field, f"must be at most {limit} characters (got {n})")


# ---------------------------------------------------------------------------------- gRPC messages
def check_generate(req: pb.GenerateRequest, caps: RequestCaps) -> str | None:
    """What is over its cap in a parsed GenerateRequest (the validator's field names), or None.
    Only lengths are read: a protobuf repeated field knows its length without building its items."""
    sp = req.sampling
    n_ids = len(req.prompt_token_ids)
    if n_ids >= caps.max_model_len:
        return f"prompt_token_ids: {context_exceeded(caps.max_model_len, n_ids)}"
    if (problem := raw_list_problem(len(sp.stop), caps.stop_strings)) is not None:
        return f"sampling.stop: {problem}"
    if (problem := raw_list_problem(len(sp.stop_token_ids), caps.stop_token_ids)) is not None:
        return f"sampling.stop_token_ids: {problem}"
    if len(sp.logit_bias) > caps.logit_bias:
        return f"sampling.logit_bias: at most {caps.logit_bias} entries (got {len(sp.logit_bias)})"
    so = sp.structured_outputs
    which = so.WhichOneof("kind") if sp.HasField("structured_outputs") else None
    if which in ("json_schema", "regex", "grammar") and len(getattr(so, which)) > caps.structured_chars:
        return f"sampling.structured_outputs.{which}: must be at most {caps.structured_chars} characters"
    if which == "choice" and sum(len(v) for v in so.choice.values) > caps.structured_chars:
        return f"sampling.structured_outputs.choice: must be at most {caps.structured_chars} characters"
    return None


def error_to_wire(e: ApiError) -> list[Any]:
    return [e.status, e.message, e.param, e.code]


def error_from_wire(values: list[Any]) -> ApiError:
    status, message, param, code = values
    return ApiError(status, message, param=param, code=code)
