"""The Responses API's request body (``POST /v1/responses``): its typed declaration.

Decoded by msgspec as the chat body is (openai_types.decode: a wrong JSON type is a 400 naming
its path; ``null`` means the default; unknown fields are ignored, as the chat route ignores
them). What the fields mean, and which are refused, is responses_api_fields.py's.

Fields that would change the output and are not served here are declared so that they can be
refused by name rather than silently dropped (``previous_response_id``, ``include``, ...). ``tools``
is decoded under another attribute name: the counts check shared by every body
(guards/request_caps.check_openai) reads a ``tools`` attribute as chat's ToolDefs.
"""

from __future__ import annotations

from typing import Any

import msgspec

from scheduler_svc.front.http.openai_types import SamplingExtras, _Body


class InputPart(_Body, kw_only=True):
    """A part of an input message's content: ``input_text`` (``output_text`` in an assistant
    message a client sends back); other types are refused by name."""

    type: str | None = None
    text: str | None = None
    refusal: str | None = None  # a part of type "refusal" (an earlier response's, sent back)


class InputItem(_Body, kw_only=True):
    """An item of ``input``: a message (``type`` "message", or no type as the easy form), a
    ``function_call`` an earlier response made, or the ``function_call_output`` that answers it."""

    type: str | None = None
    role: str | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call
    output: str | list[InputPart] | None = None  # function_call_output


class FunctionTool(_Body, kw_only=True):
    """A function tool, in the Responses API's flat form (chat nests it under ``function``)."""

    type: str | None = None
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(_Body, kw_only=True):
    """``text.format``: ``text``, ``json_object`` or ``json_schema`` (flat: name, schema, strict)."""

    type: str | None = None
    name: str | None = None
    schema: Any = None
    strict: bool | None = None
    description: str | None = None


class TextConfig(_Body, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # a hint to OpenAI's own models; echoed only


class ResponsesRequest(SamplingExtras, kw_only=True):
    """OpenAI's fields, and (from SamplingExtras) the sampling fields chat takes beyond them, vLLM's
    extensions among them, passed on to the chat path as vLLM takes them here too."""

    model: str | None = None
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    user: str | None = None  # accepted and ignored, as chat's
    metadata: dict[str, str] | None = None  # echoed back
    text: TextConfig | None = None
    store: bool | None = True  # OpenAI's default; nothing is stored here (see responses_api_fields)
    parallel_tool_calls: bool | None = None
    tool_choice: str | dict[str, Any] | None = None
    # Refused when set (responses_api_fields._refuse_unserved): they would change the output.
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    background: bool | None = False
    include: list[str] | None = None
    reasoning: Any = None
    top_logprobs: int | None = None
    truncation: str | None = None
    function_tools: list[FunctionTool] | None = msgspec.field(default=None, name="tools")
