"""One chat choice's tool calls, as OpenAI sends them: streamed ``tool_calls`` deltas, or a whole message.

Streaming: each time the choice's text grows, the parser reads it again (``ToolParser.parse``,
whose fields only grow; its JSON scans resume where the last parse stopped: the choice's
``ScanMemo``), and what grew since the last chunk is sent: new
content, then, for each call whose name is known, a first delta with its ``index``, ``id``,
``type`` and ``function.name`` (and the arguments so far), and after that only the new text of
its ``function.arguments``. Concatenating a call's argument deltas gives its arguments' text.

A whole response is what the stream adds up to once the choice ends (one parse of the whole
text): the calls whose name was read, in order up to the first without one, each with its
arguments' text as far as it goes, and the content before them. A stream cannot take back a call
it began, so a call cut short (max_tokens: finish_reason "length") is reported with its partial
arguments in both, as OpenAI reports one and vLLM a named function's; a call the model wrote
badly likewise. With no call, the whole text is the content: a stream holds back the text from
a marker on (``<tool_call>``) while a call may follow, and sends it when the choice ends without one;
but where a grammar made the text the calls (``required``), it is no content: "" then, as vLLM has it.
"""

from __future__ import annotations

from typing import Any

from scheduler_svc.front.tool_calls.json_scan import ScanMemo
from scheduler_svc.front.tool_calls.parsers import PartialCall, ToolParser


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
        calls = _named(parsed.calls)[:self.parser.max_calls]
        # (no call: what was held back too, where the text is the model's own)
        whole = self.text if final and not calls and self.parser.free_text else parsed.content
        content = whole[self.content_sent:]
        self.content_sent = max(self.content_sent, len(whole))
        deltas: list[dict[str, Any]] = []
        for i, call in enumerate(calls):
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
        """(content, tool_calls) of a whole response whose text is ``text``: what :meth:`delta`
        sends in all, chunk by chunk, for the same text (the module's docstring)."""
        parsed = self.parser.parse(text, final=True)
        calls = [{"id": self.parser.call_id(), "type": "function",
                  "function": {"name": call.name, "arguments": call.arguments}}
                 for call in _named(parsed.calls)[:self.parser.max_calls]]
        if not calls:
            return (text if self.parser.free_text else ""), None
        return parsed.content or None, calls


def _named(calls: list[PartialCall]) -> list[PartialCall]:
    """The calls to report: those whose name is known, up to the first without one (a later call
    waits for that one's name: deltas go out in order, and a whole response says the same)."""
    for i, call in enumerate(calls):
        if call.name is None:
            return calls[:i]
    return calls
