"""Tool-call parsers: a model's text -> the content a client reads and the tool calls it made.

One parser per output format, chosen with ``--tool-call-parser`` for ``tool_choice: auto`` (as
vLLM names them), plus the two a grammar enforces (``required``: a JSON array of
``{"name", "parameters"}``; a named function: the text is its arguments):

==============  ============================================================  ======================
parser          what the model writes                                          models
==============  ============================================================  ======================
``hermes``      ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``   Hermes 2/3, Qwen2/2.5
                (one block per call), content before the first block
``llama3_json`` ``{"name": ..., "parameters": {...}}``, calls separated by     Llama 3.1-3.3
                ``;``, maybe after ``<|python_tag|>``; otherwise content
``mistral``     ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``,       Mistral 7B v0.3, Nemo
                content before it
==============  ============================================================  ======================

:meth:`ToolParser.parse` reads text that may still be growing (a stream): it reports only what
can no longer change, so each field only grows between calls (content stops before a marker's
possible beginning; a call's arguments are the raw JSON text of its value, as far as it goes).
Streamed deltas are its differences (``stream.py``), each parse resuming the JSON scans of the
last (a ``ScanMemo`` per choice); a whole response is one parse of the whole text.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import ClassVar

from scheduler_svc.front.tool_calls.json_scan import ScanMemo, scan_object, skip_ws, value_end

_ALNUM = string.ascii_letters + string.digits


@dataclass(slots=True)
class PartialCall:
    name: str | None  # None until its name is complete
    arguments: str  # the raw JSON text of its arguments so far
    complete: bool  # the arguments are whole


@dataclass(slots=True)
class Parsed:
    content: str  # text for the client's `content` (never shrinks as the text grows)
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser:
    name: ClassVar[str] = ""
    max_calls: int | None = None  # set per request: 1 under parallel_tool_calls false (the first call is kept)
    # The model writes free text, and a text with no call in it is the answer's content. Not so where a
    # grammar made the text the calls (required, a named function): cut short before a call was named,
    # it is no content either (vLLM answers content "" there), never JSON markup shown as the answer.
    free_text: ClassVar[bool] = True

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> Parsed:
        """The content and calls in ``text``; ``final``: the text is whole (nothing held back);
        ``memo``: this text's, parsed shorter with it before (a stream's)."""
        raise NotImplementedError

    @staticmethod
    def call_id() -> str:
        return "call_" + secrets.token_hex(12)


def call_at(text: str, brace: int, args_keys: tuple[str, ...] = ("arguments", "parameters"),
            memo: ScanMemo | None = None) -> tuple[PartialCall, int | None]:
    """The call whose JSON object starts at ``text[brace]`` (``{``), and one past its end (None while
    incomplete). Arguments given as a JSON string (some models quote them) count once whole."""
    obj = scan_object(text, brace, memo)
    name_m = obj.get("name")
    name = None
    if name_m is not None and name_m.end is not None and text[name_m.start] == '"':
        name = json.loads(text[name_m.start:name_m.end])
    args_m = next((m for k in args_keys if (m := obj.get(k)) is not None), None)
    if args_m is None:
        return PartialCall(name, "{}" if obj.end is not None else "", obj.end is not None), obj.end
    raw = text[args_m.start:args_m.end if args_m.end is not None else len(text)]
    if raw.startswith('"'):
        if args_m.end is None:
            return PartialCall(name, "", False), None
        raw = json.loads(raw)
    return PartialCall(name, raw, args_m.end is not None), obj.end


def _held_back(text: str, marker: str) -> int:
    """Where a suffix of ``text`` that could begin ``marker`` starts (``len(text)``: none)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return len(text) - k
    return len(text)


def _before_marker(text: str, marker: str, final: bool) -> tuple[str, int]:
    """The content before ``marker`` and where the marker is (-1: not there yet)."""
    at = text.find(marker)
    if at >= 0:
        return text[:at], at
    return (text if final else text[:_held_back(text, marker)]), -1


def _array_calls(text: str, i: int, args_keys: tuple[str, ...], memo: ScanMemo | None) -> list[PartialCall]:
    """The calls of a JSON array of call objects whose ``[`` is at ``text[i]``."""
    return _call_list(text, skip_ws(text, i + 1), ",", args_keys, memo)


def _call_list(text: str, i: int, sep: str, args_keys: tuple[str, ...] = ("arguments", "parameters"),
               memo: ScanMemo | None = None) -> list[PartialCall]:
    """The call objects from ``text[i]`` on, separated by ``sep``, as far as the text goes."""
    calls = []
    while i < len(text) and text[i] == "{":
        call, end = call_at(text, i, args_keys, memo)
        calls.append(call)
        if end is None:
            break
        i = skip_ws(text, end)
        if i < len(text) and text[i] == sep:
            i = skip_ws(text, i + 1)
    return calls


class HermesParser(ToolParser):
    name = "hermes"
    START = "<tool_call>"

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> Parsed:
        content, at = _before_marker(text, self.START, final)
        out = Parsed(content)
        while at >= 0:
            brace = skip_ws(text, at + len(self.START))
            if brace < len(text) and text[brace] == "{":
                out.calls.append(call_at(text, brace, memo=memo)[0])
            at = text.find(self.START, at + len(self.START))
        return out


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> Parsed:
        i = skip_ws(text, 0)
        if text.startswith(self.PYTHON_TAG, i):
            i = skip_ws(text, i + len(self.PYTHON_TAG))
        if i >= len(text) or (not final and self.PYTHON_TAG.startswith(text[i:])):
            return Parsed(text if final else "")  # nothing yet says whether it is a call
        if text[i] != "{":
            return Parsed(text)
        return Parsed("", _call_list(text, i, ";", memo=memo))


class MistralParser(ToolParser):
    name = "mistral"
    BOT = "[TOOL_CALLS]"

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> Parsed:
        content, at = _before_marker(text, self.BOT, final)
        out = Parsed(content)
        if at >= 0:
            i = skip_ws(text, at + len(self.BOT))
            if i < len(text) and text[i] == "[":
                out.calls = _array_calls(text, i, ("arguments", "parameters"), memo)
            elif i < len(text) and text[i] == "{":
                out.calls = [call_at(text, i, memo=memo)[0]]
        return out

    @staticmethod
    def call_id() -> str:
        return "".join(secrets.choice(_ALNUM) for _ in range(9))  # Mistral's templates require 9 of these


class RequiredParser(ToolParser):
    """``tool_choice: required``: the grammar makes the text a JSON array of
    ``{"name": ..., "parameters": {...}}`` (tool_calls/requests.py writes its schema)."""

    name = "required"
    free_text = False

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> Parsed:
        i = skip_ws(text, 0)
        if i < len(text) and text[i] == "[":
            return Parsed("", _array_calls(text, i, ("parameters",), memo))
        return Parsed("")  # (the grammar's text starts with its array: no answer text either way)


class NamedParser(ToolParser):
    """A named function: the grammar makes the whole text its arguments (a JSON object)."""

    name = "named"
    free_text = False

    def __init__(self, function: str) -> None:
        self.function = function

    def parse(self, text: str, final: bool, memo: ScanMemo | None = None) -> Parsed:
        i = skip_ws(text, 0)
        if i >= len(text):
            return Parsed("", [PartialCall(self.function, "", False)])
        end = value_end(text, i, memo) if text[i] == "{" else None
        return Parsed("", [PartialCall(self.function, text[i:end if end is not None else len(text)], end is not None)])


AUTO_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}
