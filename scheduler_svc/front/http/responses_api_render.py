"""The Responses API's bodies: the whole ``response`` object, and the stream's named events.

One :class:`ResponseRender` per request, fed the engine's deltas as the chat render is (it is a
``_Render``: usage, the text so far and an aborted request's 503 are the shared code's). The
output is one assistant message with one ``output_text`` part; a request ended by its token
budget (LENGTH) is ``status: "incomplete"`` with ``incomplete_details.reason: "max_output_tokens"``,
as OpenAI reports it.

A stream is OpenAI's sequence of named server-sent events (``event: <type>`` then ``data:``), each
with its ``sequence_number``: ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, one ``response.output_text.delta``
per delta that carries text, then ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` and ``response.completed`` (or ``response.incomplete``). No
``[DONE]`` follows (OpenAI sends none). An error after the stream began is an ``error`` event
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


class ResponseRender(_Render):
    def __init__(self, response_id: str, item_id: str, model: str, texts: TokenTexts, *, prompt_tokens: int,
                 echoed: dict[str, Any]) -> None:
        """``echoed``: the request's parameters as the response repeats them (instructions, metadata, ...)."""
        super().__init__(response_id, model, 1, 1, texts, prompt_tokens=[prompt_tokens])
        self.item_id, self.echoed = item_id, echoed
        self.sequence = 0

    # -------------------------------------------------------------- whole response
    def response(self) -> dict[str, Any]:
        c = self._choice(0)
        return self._body(c.finish_reason, [self._message(c, "".join(c.text))], self._usage())

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

    def _message(self, c: _Choice, text: str, status: str | None = None) -> dict[str, Any]:
        if status is None:
            status = "incomplete" if c.finish_reason == FinishReason.LENGTH else "completed"
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
        """The events before any text: the response and its one message, begun."""
        c = self._choice(0)
        begun = self._body(None, [], None, status="in_progress")
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        return [self._event("response.created", response=begun), self._event("response.in_progress", response=begun),
                self._event("response.output_item.added", output_index=0, item=self._message(c, "", "in_progress")),
                self._event("response.content_part.added", **where, part=_part(""))]

    def chunk(self, prompt: int, out: RequestOutput) -> list[dict[str, Any]]:
        """One event per delta that carries text (held-back text, e.g. a partial character, waits)."""
        self._take(prompt, out)
        events = []
        for d in out.choices:  # (one choice: n is not part of this API)
            c = self._choice(d.index)
            if d.text:
                c.text.append(d.text)
                events.append(self._event("response.output_text.delta", item_id=self.item_id, output_index=0,
                                          content_index=0, delta=d.text, logprobs=[]))
            if d.finish_reason:
                finish_reason(d.finish_reason)  # an aborted request is an error (503) now
                c.finish_reason = d.finish_reason
        return events

    def tail(self) -> list[dict[str, Any]]:
        """The events that close the text, the part, the message and the response."""
        c = self._choice(0)
        text = "".join(c.text)
        where = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        message = self._message(c, text)
        body = self._body(c.finish_reason, [message], self._usage())
        return [self._event("response.output_text.done", **where, text=text, logprobs=[]),
                self._event("response.content_part.done", **where, part=_part(text)),
                self._event("response.output_item.done", output_index=0, item=message),
                self._event(f"response.{body['status']}", response=body)]

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


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _sse(body: dict[str, Any]) -> bytes:
    return b"event: " + body["type"].encode() + b"\n" + streams.sse_event(body)
