"""OpenAI request bodies: typed decoding, then the shared validator's RequestFields.

A body is decoded by msgspec into the Structs below (wrong JSON types fail with the field's
path); what this front adds on top of the gRPC API's fields is checked here (prompt shapes,
messages, tools, which structured-output field was used), and everything else is left to
``scheduler_svc.front.input.validation`` through :class:`RequestFields`, so both fronts apply one set of
rules. Errors are 400s naming the OpenAI field (errors.py).

Accepted beyond OpenAI's own fields, as vLLM does: ``top_k`` (-1 or 0: off), ``min_p``,
``min_tokens``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``,
``include_stop_str_in_output``, ``skip_special_tokens``, ``prompt_logprobs``, ``use_beam_search``
(beam width ``n``, best beam first), ``length_penalty``, ``early_stopping``, ``return_token_ids``
(each choice also carries its token ids), ``structured_outputs`` (and its older names
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``) and, for chat,
``add_generation_prompt``, ``continue_final_message`` and ``chat_template_kwargs``. ``user`` and
unknown fields are ignored;
fields that would change the output and are not implemented (``suffix``, ``best_of`` > n, a
structural tag, non-text content parts, vLLM's ``truncate_prompt_tokens``, ``allowed_token_ids``,
``bad_words``, ``return_tokens_as_token_ids`` and, for chat, ``echo`` and ``chat_template``) are
rejected, never silently dropped. ``null`` in any field means its default (OpenAI's fields are
"<type> or null"), never a 400.
"""

from __future__ import annotations

import functools
import re
import sys
from typing import Any

import msgspec

from scheduler_svc.front.api_errors import ApiError, bad_field
from scheduler_svc.front.http.limits import HttpLimits
from scheduler_svc.front.input.request_fields import RequestFields
from scheduler_svc.front.input.structured import StructuredFields

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


class _Body(msgspec.Struct):
    """An object of a request body. JSON ``null`` in a field means its default, as in OpenAI's
    "<type> or null" fields (and vLLM's Optional ones): a field whose default is not None is typed
    ``X | None`` so that null decodes, and is given its default back here."""

    def __post_init__(self) -> None:
        for name, default in _defaults(type(self)):
            if getattr(self, name) is None:
                setattr(self, name, default)


@functools.cache
def _defaults(kind: type[msgspec.Struct]) -> tuple[tuple[str, Any], ...]:
    """``kind``'s fields whose default is not None, with it (all immutable: bools, ints, strings)."""
    return tuple((f.name, f.default) for f in msgspec.structs.fields(kind)
                 if f.default is not None and f.default is not msgspec.NODEFAULT)


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM: every chunk carries the usage so far


class JsonSchemaFormat(_Body):
    name: str | None = None
    schema: Any = None
    strict: bool | None = None  # always strict here: the grammar enforces the schema
    description: str | None = None


class ResponseFormat(_Body):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Body, kw_only=True):
    """vLLM's ``structured_outputs``: exactly one of these."""

    json: Any = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Any = None  # rejected: not implemented


class _Request(_Body, kw_only=True):
    """Fields both endpoints share."""

    model: str | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    response_format: ResponseFormat | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = 0
    repetition_penalty: float | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    prompt_logprobs: int | None = None
    use_beam_search: bool | None = False
    length_penalty: float | None = None
    early_stopping: bool | None = False
    return_token_ids: bool | None = False
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Not implemented; rejected when they would change the output (_reject_unsupported).
    best_of: int | None = None
    truncate_prompt_tokens: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    return_tokens_as_token_ids: Any = None


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[str | int | list[int]] | None = None
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None


class FunctionCall(_Body):
    name: str
    arguments: str | dict[str, Any] | None = "{}"


class ToolCall(_Body):
    function: FunctionCall
    id: str | None = None
    type: str | None = "function"


class ChatMessage(_Body):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDef(_Body):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Body):
    function: FunctionDef
    type: str | None = "function"


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    function: NamedFunction
    type: str | None = "function"


class ChatRequest(_Request, kw_only=True):
    messages: list[ChatMessage] | None = None
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False  # vLLM's: the last message is left open, to be continued
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: more variables for the template
    tools: list[ToolDef] | None = None
    tool_choice: str | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    echo: Any = None  # vLLM's; not implemented (_reject_unsupported)
    chat_template: Any = None  # vLLM's; not implemented (_reject_unsupported)


class TokenizeRequest(_Body, kw_only=True):
    """vLLM's /tokenize (utility_routes.py)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template has them)
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(_Body, kw_only=True):
    """vLLM's /detokenize (utility_routes.py)."""

    tokens: list[int]
    model: str | None = None


_PATH = re.compile(r"at `\$\.?([^`]*)`")
_OUT_OF_RANGE = "Number out of range"


def decode(body: bytes, kind: type[msgspec.Struct]) -> Any:
    """Bytes -> ``kind``; malformed JSON or a wrong type is a 400 naming the field's path."""
    try:
        return msgspec.json.decode(body, type=kind)
    except msgspec.ValidationError as e:
        m = _PATH.search(str(e))
        path = m.group(1) if m else None
        message, code = _PATH.sub("", str(e)).strip(" -"), "invalid_type"
        if message == _OUT_OF_RANGE:  # msgspec's words for a number past float64 (1e400): say the limit
            message, code = f"must be a number of at most {sys.float_info.max:.1e} in magnitude (a 64-bit float)", \
                "invalid_value"
        if not path:
            raise ApiError(400, f"request body: {message}", code=code) from None
        raise bad_field(path, message, code=code) from None
    except msgspec.DecodeError as e:
        raise ApiError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None
    except RecursionError:  # e.g. [[[[...]]]] in a free-form field: rejected, never a crash
        raise ApiError(400, "request body: JSON nested too deeply", code="invalid_json") from None


def completion_fields(req: CompletionRequest, limits: HttpLimits) -> list[RequestFields]:
    """One RequestFields per prompt of the request (a list of prompts is a batch). ``echo`` with
    ``logprobs`` asks for the prompt's log-probs too (computed while it is prefilled); ``echo`` with
    ``max_tokens`` 0 scores the prompt alone (:func:`echo_only`): one token is generated, and dropped."""
    if req.suffix:
        raise bad_field("suffix", "is not supported", code="unsupported")
    common = _common(req, 1 if echo_only(req) else req.max_tokens, "max_tokens")
    common["logprobs"] = req.logprobs
    if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
        common["prompt_logprobs"] = req.logprobs
    return [RequestFields(prompt=p, **common) if isinstance(p, str) else RequestFields(prompt_token_ids=p, **common)
            for p in prompts(req.prompt, limits)]


def echo_only(req: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens`` 0: the answer is the prompt (and its log-probs) alone, nothing
    generated, as OpenAI and vLLM answer it (lm-eval-harness scores prompts so)."""
    return bool(req.echo) and req.max_tokens == 0


def chat_fields(req: ChatRequest) -> RequestFields:
    """The fields of a chat request; its prompt (the rendered messages) is set by the caller, and so
    is the grammar of ``tool_choice`` required or named (``tool_calls.plan_tools``)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_field("top_logprobs", "requires logprobs to be true")
    check_final_message(req)
    if req.max_completion_tokens is not None:
        common = _common(req, req.max_completion_tokens, "max_completion_tokens")
    else:
        common = _common(req, req.max_tokens, "max_tokens")
    common["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    return RequestFields(**common)


def check_final_message(req: ChatRequest | TokenizeRequest) -> None:
    """vLLM's rule: the last message is either continued or followed by the assistant's turn."""
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_field("continue_final_message", "cannot be combined with add_generation_prompt=true (its "
                                                  "default): set add_generation_prompt to false")


def _common(req: _Request, max_tokens: int | None, max_tokens_name: str) -> dict[str, Any]:
    _reject_unsupported(req)
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
        frequency_penalty=req.frequency_penalty, logit_bias=_logit_bias(req.logit_bias), min_tokens=req.min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, prompt_logprobs=req.prompt_logprobs,
        structured=structured_fields(req))
    if req.use_beam_search:  # vLLM: n beams, returned best first; width 1 is greedy
        fields["n"], fields["beam_width"] = 0, (n or 1)
        if (n or 1) == 1:
            fields["temperature"] = 0.0
    return fields


# vLLM's fields whose effect on the output is not implemented: set (truthy), they are a 400, not ignored.
_UNSUPPORTED = ("truncate_prompt_tokens", "allowed_token_ids", "bad_words", "return_tokens_as_token_ids")
_UNSUPPORTED_IN_CHAT = ("echo", "chat_template")


def _reject_unsupported(req: _Request) -> None:
    for name in _UNSUPPORTED + (_UNSUPPORTED_IN_CHAT if isinstance(req, ChatRequest) else ()):
        if getattr(req, name):
            raise bad_field(name, "is not supported by this server", code="unsupported")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_field("best_of", f"must equal n when given (got best_of={req.best_of}, n={req.n or 1})",
                        code="unsupported")


# A logit_bias key (JSON object keys are strings; OpenAI's are token ids): ASCII digits only, as
# str.isdigit() and int() would take "²" (int() fails: a 500), "٣" (token 3) or 5,000 digits (int() fails).
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,19}")


def _logit_bias(bias: dict[str, float] | None) -> list[tuple[int, float]]:
    out = []
    for key, value in (bias or {}).items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise bad_field("logit_bias", f"keys must be token ids, decimal integers of at most 19 digits "
                                          f"(got {key[:40]!r})")
        out.append((int(key), value))
    return out


def structured_fields(req: _Request) -> StructuredFields | None:
    """The one structured-output field a request used (a 400 when it used two)."""
    found: list[StructuredFields] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(StructuredFields(field="response_format", json_object=True))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema is None:
                raise bad_field("response_format.json_schema.schema", "is required with type 'json_schema'")
            found.append(StructuredFields(field="response_format", json_schema=rf.json_schema.schema))
        else:
            raise bad_field("response_format.type", f"must be 'text', 'json_object' or 'json_schema' "
                                                    f"(got {rf.type[:40]!r})", code="unsupported")
    so = req.structured_outputs
    if so is not None:
        if so.structural_tag is not None:
            raise bad_field("structured_outputs.structural_tag", "is not supported", code="unsupported")
        found.append(StructuredFields(field="structured_outputs", json_schema=so.json, regex=so.regex,
                                      choice=so.choice, grammar=so.grammar, json_object=bool(so.json_object)))
    for name, kw in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                     ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append(StructuredFields(field=name, **{kw: value}))
    if len(found) > 1:
        raise bad_field(found[1].field, f"cannot be combined with {found[0].field}: one grammar per request")
    return found[0] if found else None


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


def is_batch(prompt: str | list[str | int | list[int]] | None) -> bool:
    """Whether ``prompt``, one :func:`prompts` took, is a list of prompts (of strings or of token-id
    lists), even of one. (Its first item tells: :func:`prompts` refused a list of mixed items, so a
    prompt of token ids, up to max_model_len of them, is not scanned again.)"""
    return isinstance(prompt, list) and bool(prompt) and not _is_int(prompt[0])


def _is_int(x: Any) -> bool:
    return type(x) is int  # JSON true/false decode to bool, a subclass of int
