"""OpenAI response bodies and stream chunks, built from the engine's RequestOutput deltas.

One :class:`CompletionRender` or :class:`ChatRender` per HTTP request. A request of several
prompts (a completions batch) runs as one engine request per prompt; prompt ``p``'s choice
``c`` is the response's choice ``p * n + c``, and usage is summed over prompts. A stream chunk
carries one choice (OpenAI's clients assume so with n > 1).

Finish reasons are OpenAI's: EOS and STOP -> "stop" ("tool_calls" when the choice called tools
under ``tool_choice`` auto or required), LENGTH -> "length". A request the server aborts (it
shut down before the request finished) is a 503 error, in the stream or as the response.

Log-probabilities (``logprob_forms.py``) come in the two OpenAI forms; completions list, at each
position, up to ``logprobs`` + 1 alternatives, always with the sampled token. Chat choices may
carry tool calls (``scheduler_svc/tool_calls``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from pagedserve.engine_api import ChoiceDelta, FinishReason, RequestOutput, TokenLogprob, Usage
from scheduler_svc.front.api_errors import ApiError
from scheduler_svc.front.http.logprob_forms import (
    TextOffsets,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_body,
)
from scheduler_svc.front.http.token_texts import TokenTexts
from scheduler_svc.front.tool_calls import ChoiceToolCalls, ToolPlan

FINISH_REASON = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length"}


def finish_reason(reason: FinishReason) -> str:
    """OpenAI's word for why a choice ended; a request the server aborted is an error (503)."""
    if reason == FinishReason.ABORTED:
        raise ApiError(503, "the server shut down before the request finished", code="shutting_down")
    return FINISH_REASON[reason]


@dataclass(slots=True)
class _Choice:
    """What a choice has produced so far (non-streaming responses), and its stream state."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None  # (vLLM's: the stop string or stop token id that ended it)
    started: bool = False  # its first delta went out (role / echo are sent once)
    generated: int = 0  # tokens so far, held-back ones too (a stream's continuous usage, as vLLM counts them)
    offsets: TextOffsets | None = None  # completions logprobs: where the next token starts
    tools: ChoiceToolCalls | None = None  # chat with tools: its calls


class _Render:
    OBJECT = ""
    CHUNK_OBJECT = ""
    PROMPT_IDS_AT_TOP = False  # return_token_ids: the prompt's ids in the response (chat), else in each choice

    def __init__(self, response_id: str, model: str, n: int, num_prompts: int, texts: TokenTexts, *,
                 return_token_ids: bool = False, include_usage: bool = False, continuous_usage: bool = False,
                 prompt_tokens: list[int] | None = None, echo: list[str] | None = None,
                 prompt_ids: list[list[int]] | None = None) -> None:
        self.id, self.model, self.n = response_id, model, n
        self.created = int(time.time())
        self.texts, self.return_token_ids, self.include_usage = texts, return_token_ids, include_usage
        self.continuous_usage = continuous_usage  # every chunk carries the usage so far (vLLM's extension)
        self.echo = echo  # per prompt, prepended to each of its choices (completions only)
        self.prompt_ids = prompt_ids  # per prompt, its tokens (echo's log-probs and return_token_ids name them)
        self.choices: dict[int, _Choice] = {}
        self.usage: list[Usage | None] = [None] * num_prompts
        self.prompt_tokens = prompt_tokens or [0] * num_prompts
        self.prompt_logprobs: list[list[TokenLogprob | None] | None] = [None] * num_prompts

    # -------------------------------------------------------------- shared
    def _choice(self, index: int) -> _Choice:
        c = self.choices.get(index)
        if c is None:
            c = self.choices[index] = self._new_choice()
        return c

    def _new_choice(self) -> _Choice:
        return _Choice()

    def _take(self, prompt: int, out: RequestOutput) -> None:
        if out.usage is not None:
            self.usage[prompt] = out.usage
        if out.prompt_logprobs is not None:
            self.prompt_logprobs[prompt] = out.prompt_logprobs

    def usage_body(self) -> dict[str, int | dict[str, int]]:
        done = [u for u in self.usage if u is not None]
        prompt = sum(u.prompt_tokens for u in done)
        completion = sum(u.completion_tokens for u in done)
        body = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(u.cached_prompt_tokens for u in done)}}
        proposed = sum(u.spec_proposed_tokens for u in done)
        if proposed:  # an extension (vLLM's usage has none): only where the request was speculated
            body["speculative_decoding"] = {"proposed_tokens": proposed,
                                            "accepted_tokens": sum(u.spec_accepted_tokens for u in done)}
        return body

    def _usage_so_far(self, prompt: int, c: _Choice) -> dict[str, int]:
        """A chunk's continuous usage: its own prompt and choice, as vLLM's streams count them (the
        final usage chunk sums every choice)."""
        prompt_tokens = self.prompt_tokens[prompt]
        return {"prompt_tokens": prompt_tokens, "completion_tokens": c.generated,
                "total_tokens": prompt_tokens + c.generated}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -------------------------------------------------------------- streaming
    def chunk(self, prompt: int, out: RequestOutput) -> list[dict[str, Any]]:
        """The stream chunks of one engine delta: one per choice that has something to send."""
        self._take(prompt, out)
        chunks = []
        for d in out.choices:
            index = prompt * self.n + d.index
            c = self._choice(index)
            c.generated += len(d.token_ids)
            body = self._delta(index, c, d, prompt)
            if body is None:
                continue  # text held back (a partial UTF-8 character, a stop string, a tool call's markup)
            first, c.started = not c.started, True
            if d.finish_reason:
                body["finish_reason"] = self._finish(c, d.finish_reason)
                body["stop_reason"] = d.stop_reason
            msg = self._head(self.CHUNK_OBJECT)
            msg["choices"] = [body]
            if self.return_token_ids:  # (vLLM's: the prompt's ids with each choice's first chunk)
                if first and self.prompt_ids is not None:
                    (msg if self.PROMPT_IDS_AT_TOP else body)["prompt_token_ids"] = self.prompt_ids[prompt]
                body["token_ids"] = d.token_ids
            if self.continuous_usage:
                msg["usage"] = self._usage_so_far(prompt, c)
            elif self.include_usage:
                msg["usage"] = None  # OpenAI: every chunk has the key, the last one (choices: []) the value
            chunks.append(msg)
        return chunks

    def usage_chunk(self) -> dict[str, Any]:
        msg = self._head(self.CHUNK_OBJECT)
        msg["choices"] = []
        msg["usage"] = self.usage_body()
        return msg

    def _delta(self, index: int, c: _Choice, d: ChoiceDelta, prompt: int) -> dict[str, Any] | None:
        raise NotImplementedError

    def _finish(self, c: _Choice, reason: FinishReason) -> str:
        return finish_reason(reason)

    def _quiet(self, c: _Choice, d: ChoiceDelta) -> bool:
        """Nothing of ``d`` needs a chunk (its text is held back, and it ends nothing)."""
        return c.started and not (d.text or d.finish_reason or d.logprobs or self.return_token_ids)

    # -------------------------------------------------------------- whole response
    def add(self, prompt: int, out: RequestOutput) -> None:
        """Accumulate one engine delta for a non-streaming response."""
        self._take(prompt, out)
        for d in out.choices:
            c = self._choice(prompt * self.n + d.index)
            c.text.append(d.text)
            c.token_ids.extend(d.token_ids)
            c.logprobs.extend(d.logprobs)
            if d.finish_reason:
                finish_reason(d.finish_reason)  # (an aborted request is an error now)
                c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason

    def response(self) -> dict[str, Any]:
        msg = self._head(self.OBJECT)
        msg["choices"] = [self._whole(i, self.choices[i]) for i in sorted(self.choices)]
        msg["usage"] = self.usage_body()
        return msg

    def _whole(self, index: int, c: _Choice) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRender(_Render):
    OBJECT = CHUNK_OBJECT = "text_completion"

    def __init__(self, *args: Any, skip_special_tokens: bool = True, echo_only: bool = False,
                 want_logprobs: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.skip_special_tokens = skip_special_tokens  # as the engine decodes the text (text_offset follows it)
        # echo with max_tokens 0 (openai_fields.echo_only): the token generated is dropped, from the
        # text, log-probs, token ids and usage alike; the choice ends by "length".
        self.echo_only, self.want_logprobs = echo_only, want_logprobs

    def chunk(self, prompt: int, out: RequestOutput) -> list[dict[str, Any]]:
        return super().chunk(prompt, _nothing_generated(out) if self.echo_only else out)

    def add(self, prompt: int, out: RequestOutput) -> None:
        super().add(prompt, _nothing_generated(out) if self.echo_only else out)

    def _delta(self, index: int, c: _Choice, d: ChoiceDelta, prompt: int) -> dict[str, Any] | None:
        if self._quiet(c, d):
            return None
        text = d.text
        logprobs = None
        if not c.started and self.echo is not None:
            text = self.echo[prompt] + text
            if (d.logprobs or self.echo_only and self.want_logprobs) and self.prompt_logprobs[prompt] is not None:
                logprobs = self._echo_logprobs(prompt)
        if d.logprobs:
            if c.offsets is None:
                c.offsets = self._offsets(prompt)
            body = completion_logprobs(self.texts, d.logprobs, c.offsets)
            logprobs = body if logprobs is None else {k: logprobs[k] + body[k] for k in body}
        out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": None}
        if not c.started and self.prompt_logprobs[prompt] is not None:
            out["prompt_logprobs"] = prompt_logprobs_body(self.texts.text, self.prompt_logprobs[prompt])
        return out

    def _echo_logprobs(self, prompt: int) -> dict[str, Any]:
        """The echoed prompt's tokens with their log-probs (the first has none), placed in the
        prompt's text as decoded (an echo of token ids is that text; special tokens left out)."""
        ids = self.prompt_ids[prompt] if self.prompt_ids is not None else None
        return completion_logprobs(self.texts, self.prompt_logprobs[prompt], TextOffsets(self.texts, text_start=True),
                                   ids)

    def _offsets(self, prompt: int) -> TextOffsets:
        """The generated tokens' offsets: from the end of the echo, in the text the engine decodes."""
        start = len(self.echo[prompt]) if self.echo is not None else 0
        return TextOffsets(self.texts, start, skip_special=self.skip_special_tokens)

    def _whole(self, index: int, c: _Choice) -> dict[str, Any]:
        prompt = index // self.n
        echo = self.echo[prompt] if self.echo is not None else ""
        logprobs = None
        if c.logprobs or self.echo_only and self.want_logprobs:
            logprobs = completion_logprobs(self.texts, c.logprobs, self._offsets(prompt))
            if self.echo is not None and self.prompt_logprobs[prompt] is not None:
                head = self._echo_logprobs(prompt)
                logprobs = {k: head[k] + logprobs[k] for k in logprobs}
        body = {"index": index, "text": echo + "".join(c.text), "logprobs": logprobs,
                "finish_reason": finish_reason(c.finish_reason) if c.finish_reason else None,
                "stop_reason": c.stop_reason}
        if self.prompt_logprobs[prompt] is not None:
            body["prompt_logprobs"] = prompt_logprobs_body(self.texts.text, self.prompt_logprobs[prompt])
        if self.return_token_ids:
            if self.prompt_ids is not None:
                body["prompt_token_ids"] = self.prompt_ids[prompt]
            body["token_ids"] = c.token_ids
        return body


def _nothing_generated(out: RequestOutput) -> RequestOutput:
    """``out`` without what it generated: each choice's end alone, by "length" (its EOS or stop
    token was dropped too), and no completion tokens."""
    usage = msgspec.structs.replace(out.usage, completion_tokens=0) if out.usage is not None else None
    ended = (FinishReason.EOS, FinishReason.STOP)
    return msgspec.structs.replace(out, usage=usage, choices=[
        ChoiceDelta(d.index, finish_reason=FinishReason.LENGTH if d.finish_reason in ended else d.finish_reason)
        for d in out.choices])


class ChatRender(_Render):
    OBJECT, CHUNK_OBJECT = "chat.completion", "chat.completion.chunk"
    PROMPT_IDS_AT_TOP = True

    def __init__(self, *args: Any, tools: ToolPlan | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tools = tools

    def _new_choice(self) -> _Choice:
        parser = self.tools.parser if self.tools is not None else None
        return _Choice(tools=ChoiceToolCalls(parser) if parser is not None else None)

    def _delta(self, index: int, c: _Choice, d: ChoiceDelta, prompt: int) -> dict[str, Any] | None:
        delta: dict[str, Any] = {"role": "assistant"} if not c.started else {}
        if c.tools is None:
            if self._quiet(c, d):
                return None
            delta["content"] = d.text
        else:
            content, calls = c.tools.delta(d.text, d.finish_reason != FinishReason.UNSPECIFIED)
            if content or not c.started:
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
            if c.started and not (content or calls or d.finish_reason or d.logprobs or self.return_token_ids):
                return None
        lp = {"content": chat_logprobs(self.texts, d.logprobs)} if d.logprobs else None
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}

    def _finish(self, c: _Choice, reason: FinishReason) -> str:
        word = finish_reason(reason)
        if word == "stop" and c.tools is not None and c.tools.called and self.tools.finish_reason:
            return self.tools.finish_reason
        return word

    def _whole(self, index: int, c: _Choice) -> dict[str, Any]:
        text = "".join(c.text)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        word = finish_reason(c.finish_reason) if c.finish_reason else None
        if c.tools is not None:
            content, calls = c.tools.message(text)
            message["content"] = content
            if calls:
                message["tool_calls"] = calls
                if word == "stop" and self.tools.finish_reason:
                    word = self.tools.finish_reason
        body = {"index": index, "message": message,
                "logprobs": {"content": chat_logprobs(self.texts, c.logprobs)} if c.logprobs else None,
                "finish_reason": word, "stop_reason": c.stop_reason}
        if self.return_token_ids:
            body["token_ids"] = c.token_ids
        return body

    def response(self) -> dict[str, Any]:
        msg = super().response()
        if self.prompt_logprobs[0] is not None:
            msg["prompt_logprobs"] = prompt_logprobs_body(self.texts.text, self.prompt_logprobs[0])
        if self.return_token_ids and self.prompt_ids is not None:
            msg["prompt_token_ids"] = self.prompt_ids[0]
        return msg
