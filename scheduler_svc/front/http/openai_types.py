"""OpenAI request bodies: their typed declarations and decoding (openai_fields.py turns them into
the shared validator's RequestFields).

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
``guided_json``, ``guided_regex``, ``guided_choice``, ``guided_grammar``), ``cache_salt``,
``truncate_prompt_tokens``, ``add_special_tokens`` and, for chat, ``add_generation_prompt``,
``continue_final_message``, ``chat_template_kwargs`` and ``documents``. ``user``, ``priority`` 0,
``spaces_between_special_tokens``, ``guided_decoding_backend`` and unknown fields are ignored
(none changes the output here);
fields that would change the output and are not implemented (``suffix``, ``best_of`` > n, a
structural tag, non-text content parts, a non-zero ``priority``, vLLM's ``allowed_token_ids``,
``bad_words``, ``return_tokens_as_token_ids``, ``guided_whitespace_pattern``,
``logits_processors``, ``vllm_xargs`` and, for chat, ``echo`` and ``chat_template``) are
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


class SamplingExtras(_Body, kw_only=True):
    """What every generating endpoint takes beyond its own API's fields: OpenAI's chat and
    completions sampling fields the Responses API lacks, and vLLM's extensions (vLLM takes them
    on /v1/responses too). The Responses API passes them on to the chat path as they are
    (responses_api_fields.py)."""

    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
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
    cache_salt: str | None = None  # prefix-cache blocks shared only among requests of the same salt
    truncate_prompt_tokens: int | None = None  # the prompt's last k tokens (-1: all)
    priority: int | None = 0  # only 0: no priority scheduling here (vLLM refuses others so too)
    # Accepted with no effect, as vLLM gives them none here: the fast tokenizer's detokenizing
    # ignores spaces_between_special_tokens (vLLM's too); one grammar engine serves every request.
    spaces_between_special_tokens: bool | None = True
    guided_decoding_backend: str | None = None
    # Not implemented; rejected when they would change the output (_reject_unsupported).
    best_of: int | None = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    return_tokens_as_token_ids: Any = None
    guided_whitespace_pattern: Any = None
    logits_processors: Any = None
    vllm_xargs: Any = None


class _Request(SamplingExtras, kw_only=True):
    """Fields both endpoints share."""

    model: str | None = None
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored
    response_format: ResponseFormat | None = None


class CompletionRequest(_Request, kw_only=True):
    prompt: str | list[str | int | list[int]] | None = None
    add_special_tokens: bool | None = True  # vLLM's: the tokenizer's BOS and such, added to a text prompt
    max_tokens: int | None = None
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None


class ContentPart(_Body):
    type: str
    text: str | None = None
    refusal: str | None = None  # a part of type "refusal" (an assistant's, replayed in a history)


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
    documents: list[dict[str, str]] | None = None  # vLLM's: for a RAG template's `documents`
    add_special_tokens: bool | None = False  # vLLM's: the template has them; True adds the tokenizer's too
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
    """Bytes -> ``kind``; malformed JSON or a wrong type is a 400 naming the field's path.

    Lax, as vLLM's pydantic models are: a whole float where an integer goes (``max_tokens: 5.0``,
    what a client that keeps numbers as floats sends) and a number or boolean written as a string
    (``"5"``, ``"true"``) are taken; ``5.5`` for an integer, or a number where text goes, is not."""
    try:
        return msgspec.json.decode(body, type=kind, strict=False)
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
