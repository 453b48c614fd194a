"""The Responses API's bodies: the whole ``response`` object, and the stream's named events.

One :class:`ResponseRender` per request, fed the engine's deltas as the chat render is (it is a
``_Render``: usage, the text so far and an aborted request's 503 are the shared code's). The
output is an assistant message with one ``output_text`` part, and with tools, a ``function_call``
item per call its text makes (read by chat's tool-call parsers: tool_calls/); a message only when
there is content or no call, as OpenAI answers. A request ended by its token budget (LENGTH) is
``status: "incomplete"`` with ``incomplete_details.reason: "max_output_tokens"``, as OpenAI reports it.

A stream is OpenAI's sequence of named server-sent events (``event: <type>`` then ``data:``), each
with its ``sequence_number``: ``response.created``, ``response.in_progress``; an item is opened
when its first text arrives (``response.output_item.added``, and a message's
``response.content_part.added``), grows by ``response.output_text.delta`` or
``response.function_call_arguments.delta`` events, and is closed once the request ends
(``response.output_text.done`` and ``response.content_part.done``, or
``response.function_call_arguments.done``; then ``response.output_item.done``), before
``response.completed`` (or ``response.incomplete``). No ``[DONE]`` follows (OpenAI sends none). An error after the stream began is an ``error`` event
whose body also carries chat's ``{"error": {...}}``, so the openai client raises it as an APIError
as it does mid-chat-stream.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from pagedserve.engine_api import FinishReason, RequestOutput
from scheduler_svc.front.http import streams
from scheduler_svc.front.http.responses import _Choice, _Render, finish_reason
from scheduler_svc.front.http.token_texts import TokenTexts
from scheduler_svc.front.tool_calls import ChoiceToolCalls, ToolPlan


class ResponseRender(_Render):
    def __init__(self, response_id: str, item_id: str, model: str, texts: TokenTexts, *, prompt_tokens: int,
                 echoed: dict[str, Any], tools: ToolPlan | None = None) -> None:
        """``echoed``: the request's parameters as the response repeats them (instructions, metadata, ...);
        ``item_id``: its message's id; ``tools``: how its text is read for calls (app.py's chat_requests)."""
        super().__init__(response_id, model, 1, 1, texts, prompt_tokens=[prompt_tokens])
        self.item_id, self.echoed, self.tools = item_id, echoed, tools
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # a stream's output items as opened, in output order
        self.message_index: int | None = None  # where its message is in self.items, once opened
        self.content: list[str] = []  # the message's text streamed so far
        self.calls: list[dict[str, Any]] = []  # its function_call items by the parser's call index

    def _new_choice(self) -> _Choice:
        parser = self.tools.parser if self.tools is not None else None
        return _Choice(tools=ChoiceToolCalls(parser) if parser is not None else None)

    # -------------------------------------------------------------- whole response
    def response(self) -> dict[str, Any]:
        c = self._choice(0)
        text, status = "".join(c.text), _item_status(c.finish_reason)
        content, calls = c.tools.message(text) if c.tools is not None else (text, None)
        output = [self._message(content or "", status)] if content or not calls else []
        output += [_call(call["id"], call["function"]["name"], call["function"]["arguments"], status)
                   for call in calls or []]
        return self._body(c.finish_reason, output, self._usage())

    def _body(self, reason: FinishReason | None, output: list[dict[str, Any]],
              usage: dict[str, Any] | None, status: str | None = None) -> dict[str, Any]:
        """The ``response`` object; ``status`` given (in progress), else the one ``reason`` makes."""
        incomplete = reason == FinishReason.LENGTH
        if status is None:
            status = "incomplete" if incomplete else "completed"
        return {"id": self.id, "object": "response", "created_at": self.created, "status": status,
                "completed_at": int(time.time()) if status == "completed" else None,
                "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None, "error": None,
                "model": self.model, "output": output, "usage": usage, **self.echoed}

    def _message(self, text: str, status: str) -> dict[str, Any]:
        content = [_part(text)] if status != "in_progress" else []
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def _usage(self) -> dict[str, Any]:
        u = self.usage_body()
        return {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                "total_tokens": u["total_tokens"],
                "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens_details": {"reasoning_tokens": 0}}

    # -------------------------------------------------------------- stream
    def head(self) -> list[dict[str, Any]]:
        begun = self._body(None, [], None, status="in_progress")
        return [self._event("response.created", response=begun), self._event("response.in_progress", response=begun)]

    def chunk(self, prompt: int, out: RequestOutput) -> list[dict[str, Any]]:
        """The events of one engine delta: the message's text, the calls' arguments (what a tool
        parser holds back, e.g. a partial ``<tool_call>`` marker, waits)."""
        self._take(prompt, out)
        events: list[dict[str, Any]] = []
        for d in out.choices:  # (one choice: n is not part of this API)
            c = self._choice(d.index)
            if c.tools is None:
                content, calls = d.text, []
            else:
                content, calls = c.tools.delta(d.text, d.finish_reason != FinishReason.UNSPECIFIED)
            if content:
                events += self._text_delta(content)
            for call in calls:
                events += self._call_delta(call)
            if d.finish_reason:
                finish_reason(d.finish_reason)  # an aborted request is an error (503) now
                c.finish_reason = d.finish_reason
        return events

    def _open(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        index = len(self.items) - 1
        events = [self._event("response.output_item.added", output_index=index, item=dict(item))]
        if item["type"] == "message":
            self.message_index = index
            events.append(self._event("response.content_part.added", item_id=self.item_id, output_index=index,
                                      content_index=0, part=_part("")))
        return events

    def _text_delta(self, text: str) -> list[dict[str, Any]]:
        events = self._open(self._message("", "in_progress")) if self.message_index is None else []
        self.content.append(text)
        return events + [self._event("response.output_text.delta", item_id=self.item_id,
                                     output_index=self.message_index, content_index=0, delta=text, logprobs=[])]

    def _call_delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat ``tool_calls`` delta (tool_calls.ChoiceToolCalls) as a function_call item's events."""
        events: list[dict[str, Any]] = []
        if "id" in delta:  # a call begins: its item, then the arguments it came with
            item = _call(delta["id"], delta["function"]["name"], "", "in_progress")
            self.calls.append(item)
            events += self._open(item)
        item = self.calls[delta["index"]]
        piece = delta["function"].get("arguments") or ""
        if piece:
            item["arguments"] += piece
            events.append(self._event("response.function_call_arguments.delta", item_id=item["id"],
                                      output_index=self.items.index(item), delta=piece))
        return events

    def tail(self) -> list[dict[str, Any]]:
        """The events that close each item (the message's text and part first), then the response."""
        c = self._choice(0)
        status = _item_status(c.finish_reason)
        events = self._open(self._message("", "in_progress")) if not self.items else []
        for index, item in enumerate(self.items):
            if item["type"] == "message":
                text = "".join(self.content)
                where = {"item_id": self.item_id, "output_index": index, "content_index": 0}
                events += [self._event("response.output_text.done", **where, text=text, logprobs=[]),
                           self._event("response.content_part.done", **where, part=_part(text))]
                done = self._message(text, status)
            else:
                events.append(self._event("response.function_call_arguments.done", item_id=item["id"],
                                          output_index=index, arguments=item["arguments"]))
                done = {**item, "status": status}
            self.items[index] = done
            events.append(self._event("response.output_item.done", output_index=index, item=done))
        body = self._body(c.finish_reason, list(self.items), self._usage())
        return events + [self._event(f"response.{body['status']}", response=body)]

    def error_event(self, body: dict[str, Any]) -> dict[str, Any]:
        """An error mid-stream: OpenAI's ``error`` event, with chat's ``error`` object in it."""
        err = body["error"]
        return self._event("error", code=err["code"], message=err["message"], param=err["param"], error=err)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.sequence += 1
        return {"type": kind, "sequence_number": self.sequence - 1, **fields}

    async def events(self, first: streams.Tagged, rest: AsyncIterator[streams.Tagged],
                     on_error: Callable[[BaseException], dict[str, Any]]) -> AsyncIterator[bytes]:
        """The stream's bytes (app.py's ``_respond`` hook; closing this closes ``rest``, i.e. the
        engine's request, whatever ends the response)."""
        async with contextlib.aclosing(rest):
            try:
                for body in self.head() + self.chunk(*first):
                    yield _sse(body)
                async for prompt, out in rest:
                    for body in self.chunk(prompt, out):
                        yield _sse(body)
                for body in self.tail():
                    yield _sse(body)
            except Exception as e:
                yield _sse(self.error_event(on_error(e)))


def _item_status(reason: FinishReason | None) -> str:
    return "incomplete" if reason == FinishReason.LENGTH else "completed"


def _call(call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{call_id}", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _sse(body: dict[str, Any]) -> bytes:
    return b"event: " + body["type"].encode() + b"\n" + streams.sse_event(body)
