"""What a chat request's ``tools`` and ``tool_choice`` mean: how its output is read, and the grammar
that makes ``required`` and a named function's arguments always parse.

As vLLM serves them:

- ``none`` (the default without tools): the tools are still shown to the model (its template
  renders them); its text is content, nothing is parsed.
- ``auto`` (the default with tools): the model decides; its text is parsed by the server's
  ``--tool-call-parser``, which ``--enable-auto-tool-choice`` must have turned on (else 400);
  with ``parallel_tool_calls: false`` only its first call is reported (whole and streamed).
- ``required``: a grammar makes the output a JSON array of ``{"name": <one of the tools>,
  "parameters": <its parameters' schema>}`` (one item without ``parallel_tool_calls``).
- a named function (``{"type": "function", "function": {"name": ...}}``): a grammar makes the
  output that function's arguments.

The last two need no flag. Tools are rejected with a 400 naming the field when they are not what
OpenAI's API allows (names, count, parameters that are not a JSON object).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from scheduler_svc.front.api_errors import ApiError, bad_field
from scheduler_svc.front.input.structured import StructuredFields
from scheduler_svc.front.tool_calls.parsers import AUTO_PARSERS, NamedParser, RequiredParser, ToolParser

MAX_TOOLS = 128  # OpenAI's
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
NO_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True, slots=True)
class ToolCallOptions:
    """The server's flags: ``--enable-auto-tool-choice`` and ``--tool-call-parser``."""

    enable_auto_tool_choice: bool = False
    parser: str | None = None

    def __post_init__(self) -> None:
        if self.parser is not None and self.parser not in AUTO_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(AUTO_PARSERS)} (got {self.parser!r})")
        if self.enable_auto_tool_choice and self.parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (which format the model writes)")


@dataclass(slots=True)
class ToolPlan:
    tools: list[dict[str, Any]] | None  # what the chat template renders (OpenAI's form), None: no tools
    parser: ToolParser | None  # how the output is read; None: its text is all content
    structured: StructuredFields | None  # the grammar of required / a named function
    finish_reason: str | None  # "tool_calls" when it made calls and stopped (auto, required); None: "stop"
    skip_special_tokens: bool = True  # False: the parser reads a special token (mistral's [TOOL_CALLS])


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
               options: ToolCallOptions, special_tokens: frozenset[str] = frozenset()) -> ToolPlan:
    """``tools`` as decoded (openai_types' ToolDef), ``tool_choice`` a string or a NamedToolChoice."""
    rendered = _tools(tools) if tools else None
    choice = tool_choice if tool_choice is not None else ("auto" if rendered else "none")
    if isinstance(choice, str):
        if choice == "none":
            return ToolPlan(rendered, None, None, None)
        if choice not in ("auto", "required"):
            raise bad_field("tool_choice", f"must be 'none', 'auto', 'required' or a named function (got {choice!r})")
        if rendered is None:
            raise bad_field("tool_choice", f"{choice!r} needs tools")
        if choice == "auto":
            return _auto(rendered, options, special_tokens, parallel_tool_calls is False)
        schema = _required_schema(rendered, parallel_tool_calls is False)
        return ToolPlan(rendered, RequiredParser(), StructuredFields(field="tool_choice", json_schema=schema),
                        "tool_calls")
    if choice.type != "function":
        raise bad_field("tool_choice.type", f"must be 'function' (got {choice.type[:40]!r})")
    name = choice.function.name
    if rendered is None:
        raise bad_field("tool_choice", "a named function needs tools")
    match = next((t for t in rendered if t["function"]["name"] == name), None)
    if match is None:
        raise bad_field("tool_choice.function.name", f"names no tool of the request (got {name[:64]!r})")
    schema = match["function"].get("parameters") or NO_PARAMETERS
    return ToolPlan(rendered, NamedParser(name), StructuredFields(field="tool_choice", json_schema=schema), None)


def _auto(rendered: list[dict[str, Any]], options: ToolCallOptions, special_tokens: frozenset[str],
          single: bool) -> ToolPlan:
    if not options.enable_auto_tool_choice or options.parser is None:
        raise ApiError(400, 'tool_choice: "auto" needs the server to run with --enable-auto-tool-choice and '
                            "--tool-call-parser (or ask for \"required\" or a named function)",
                       param="tool_choice", code="unsupported")
    parser = AUTO_PARSERS[options.parser]()
    if single:  # no grammar holds the model to one call: the first is kept, as vLLM keeps it
        parser.max_calls = 1
    reads_special = isinstance(getattr(parser, "BOT", None), str) and parser.BOT in special_tokens
    return ToolPlan(rendered, parser, None, "tool_calls", skip_special_tokens=not reads_special)


def _tools(tools: list[Any]) -> list[dict[str, Any]]:
    if len(tools) > MAX_TOOLS:
        raise bad_field("tools", f"at most {MAX_TOOLS} tools (got {len(tools)})")
    out, seen = [], set()
    for i, t in enumerate(tools):
        if t.type != "function":
            raise bad_field(f"tools[{i}].type", f"must be 'function' (got {t.type[:40]!r})")
        f = t.function
        if not _NAME.fullmatch(f.name):
            raise bad_field(f"tools[{i}].function.name", f"must be 1 to 64 of a-z, A-Z, 0-9, _ and - (got {f.name[:80]!r})")
        if f.name in seen:
            raise bad_field(f"tools[{i}].function.name", f"names another tool too (got {f.name!r})")
        seen.add(f.name)
        function: dict[str, Any] = {"name": f.name}
        if f.description is not None:
            function["description"] = f.description
        if f.parameters is not None:
            if f.parameters.get("type", "object") != "object":
                raise bad_field(f"tools[{i}].function.parameters", "must be a JSON schema of an object")
            function["parameters"] = f.parameters
        out.append({"type": "function", "function": function})
    return out


def _required_schema(tools: list[dict[str, Any]], single: bool) -> dict[str, Any]:
    """vLLM's schema for ``required``: an array of calls, each one tool's name and its parameters."""
    calls = [{"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                             "parameters": t["function"].get("parameters") or NO_PARAMETERS},
              "required": ["name", "parameters"]} for t in tools]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": calls}}
    if single:
        schema["maxItems"] = 1
    return schema
