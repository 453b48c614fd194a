"""One chat choice's tool calls, as OpenAI sends them: streamed ``tool_calls`` deltas, or a whole message.

Streaming: each time the choice's text grows, the parser reads it again (``ToolParser.parse``,
whose fields only grow; its JSON scans resume where the last parse stopped: the choice's
``ScanMemo``), and what grew since the last chunk is sent: new
content, then, for each call whose name is known, a first delta with its ``index``, ``id``,
``type`` and ``function.name`` (and the arguments so far), and after that only the new text of
its ``function.arguments``. Concatenating a call's argument deltas gives its arguments' text.

A whole response parses the whole text once. Calls whose arguments are not complete, valid JSON
(cut short by max_tokens, or a model that wrote something else) are not reported: with none left,
the whole text is the content, as vLLM does.
"""

from __future__ import annotations

import json
from typing import Any

from scheduler_svc.front.tool_calls.json_scan import ScanMemo
from scheduler_svc.front.tool_calls.parsers import ToolParser


class ChoiceToolCalls:
    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.content_sent = 0
        self.ids: list[str] = []  # of the calls whose first delta went out
        self.args_sent: list[int] = []
        self.memo: ScanMemo = {}  # the JSON scans of self.text so far

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def delta(self, new_text: str, final: bool) -> tuple[str, list[dict[str, Any]]]:
        """(new content, tool_calls deltas) after ``new_text``; ``final``: the choice ended."""
        self.text += new_text
        parsed = self.parser.parse(self.text, final, self.memo)
        content = parsed.content[self.content_sent:]
        self.content_sent = max(self.content_sent, len(parsed.content))
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(parsed.calls):
            if call.name is None:
                break  # a later call waits for this one's name: deltas go out in order
            if i == len(self.ids):
                self.ids.append(self.parser.call_id())
                self.args_sent.append(len(call.arguments))
                deltas.append({"index": i, "id": self.ids[i], "type": "function",
                               "function": {"name": call.name, "arguments": call.arguments}})
            elif len(call.arguments) > self.args_sent[i]:
                deltas.append({"index": i, "function": {"arguments": call.arguments[self.args_sent[i]:]}})
                self.args_sent[i] = len(call.arguments)
        return content, deltas

    def message(self, text: str) -> tuple[str | None, list[dict[str, Any]] | None]:
        """(content, tool_calls) of a whole response whose text is ``text``."""
        parsed = self.parser.parse(text, final=True)
        calls = []
        for call in parsed.calls:
            if call.name is None or not call.complete or not _is_json(call.arguments):
                continue
            calls.append({"id": self.parser.call_id(), "type": "function",
                          "function": {"name": call.name, "arguments": call.arguments}})
        if not calls:
            return text, None
        return (parsed.content if parsed.content.strip() else None), calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
