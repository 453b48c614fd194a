"""OpenAI response bodies and stream chunks, built from the engine's RequestOutput deltas.

One :class:`CompletionRender` or :class:`ChatRender` per HTTP request. A request of several
prompts (a completions batch) runs as one engine request per prompt; prompt ``p``'s choice
``c`` is the response's choice ``p * n + c``, and usage is summed over prompts. The engine's
finish reasons map to OpenAI's: EOS and STOP -> "stop", LENGTH -> "length", ABORTED (server
shutdown) -> "abort" (vLLM's word; OpenAI has none).

Log-probabilities come in the two OpenAI forms: completions (``tokens``, ``token_logprobs``,
``top_logprobs`` as {token: logprob}, ``text_offset``) and chat (``content``: a list of
{token, logprob, bytes, top_logprobs}). A token's text is its id decoded alone.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from scheduler_svc.api_types import ChoiceDelta, FinishReason, RequestOutput, TokenLogprob, Usage

FINISH_REASON = {FinishReason.EOS: "stop", FinishReason.STOP: "stop", FinishReason.LENGTH: "length",
                 FinishReason.ABORTED: "abort"}


class TokenTexts:
    """Each token id's own text (cached: logprobs name the same ids over and over)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.text = functools.lru_cache(maxsize=1 << 16)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))


@dataclass(slots=True)
class _Choice:
    """What a choice has produced so far (non-streaming responses), and its stream state."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    started: bool = False  # its first delta went out (role / echo are sent once)
    offset: int = 0  # completions logprobs: text_offset of the next token


class _Render:
    OBJECT = ""
    CHUNK_OBJECT = ""

    def __init__(self, response_id: str, model: str, n: int, num_prompts: int, texts: TokenTexts, *,
                 return_token_ids: bool = False, include_usage: bool = False,
                 echo: list[str] | None = None) -> None:
        self.id, self.model, self.n = response_id, model, n
        self.created = int(time.time())
        self.texts, self.return_token_ids, self.include_usage = texts, return_token_ids, include_usage
        self.echo = echo  # per prompt, prepended to each of its choices (completions only)
        self.choices: dict[int, _Choice] = {}
        self.usage: list[Usage | None] = [None] * num_prompts

    # -------------------------------------------------------------- shared
    def _choice(self, index: int) -> _Choice:
        c = self.choices.get(index)
        if c is None:
            c = self.choices[index] = _Choice()
        return c

    def usage_body(self) -> dict[str, int | dict[str, int]]:
        done = [u for u in self.usage if u is not None]
        prompt = sum(u.prompt_tokens for u in done)
        completion = sum(u.completion_tokens for u in done)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(u.cached_prompt_tokens for u in done)}}

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    # -------------------------------------------------------------- streaming
    def chunk(self, prompt: int, out: RequestOutput) -> dict[str, Any] | None:
        """The stream chunk for one engine delta (None if nothing to send)."""
        if out.usage is not None:
            self.usage[prompt] = out.usage
        choices = []
        for d in out.choices:
            index = prompt * self.n + d.index
            c = self._choice(index)
            if c.started and not (d.text or d.finish_reason or d.logprobs or self.return_token_ids):
                continue  # text held back (a partial UTF-8 character, a possible stop string): nothing new
            body = self._delta(index, c, d, prompt)
            c.started = True
            if d.finish_reason:
                body["finish_reason"] = FINISH_REASON.get(d.finish_reason, "stop")
            if self.return_token_ids:
                body["token_ids"] = d.token_ids
            choices.append(body)
        if not choices:
            return None
        msg = self._head(self.CHUNK_OBJECT)
        msg["choices"] = choices
        if self.include_usage:
            msg["usage"] = None  # OpenAI: every chunk has the key, the last one (choices: []) the value
        return msg

    def usage_chunk(self) -> dict[str, Any]:
        msg = self._head(self.CHUNK_OBJECT)
        msg["choices"] = []
        msg["usage"] = self.usage_body()
        return msg

    def _delta(self, index: int, c: _Choice, d: ChoiceDelta, prompt: int) -> dict[str, Any]:
        raise NotImplementedError

    # -------------------------------------------------------------- whole response
    def add(self, prompt: int, out: RequestOutput) -> None:
        """Accumulate one engine delta for a non-streaming response."""
        if out.usage is not None:
            self.usage[prompt] = out.usage
        for d in out.choices:
            c = self._choice(prompt * self.n + d.index)
            c.text.append(d.text)
            c.token_ids.extend(d.token_ids)
            c.logprobs.extend(d.logprobs)
            if d.finish_reason:
                c.finish_reason = FINISH_REASON.get(d.finish_reason, "stop")

    def response(self) -> dict[str, Any]:
        msg = self._head(self.OBJECT)
        msg["choices"] = [self._whole(i, self.choices[i]) for i in sorted(self.choices)]
        msg["usage"] = self.usage_body()
        return msg

    def _whole(self, index: int, c: _Choice) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRender(_Render):
    OBJECT = CHUNK_OBJECT = "text_completion"

    def _delta(self, index: int, c: _Choice, d: ChoiceDelta, prompt: int) -> dict[str, Any]:
        text = d.text
        if not c.started and self.echo is not None:
            text = self.echo[prompt] + text
            c.offset = len(self.echo[prompt])
        lp = self._logprobs(c, d.logprobs) if d.logprobs else None
        return {"index": index, "text": text, "logprobs": lp, "finish_reason": None}

    def _whole(self, index: int, c: _Choice) -> dict[str, Any]:
        echo = self.echo[index // self.n] if self.echo is not None else ""
        c.offset = len(echo)
        body = {"index": index, "text": echo + "".join(c.text),
                "logprobs": self._logprobs(c, c.logprobs) if c.logprobs else None,
                "finish_reason": c.finish_reason}
        if self.return_token_ids:
            body["token_ids"] = c.token_ids
        return body

    def _logprobs(self, c: _Choice, lps: list[TokenLogprob]) -> dict[str, list]:
        text = self.texts.text
        tokens, offsets = [], []
        for lp in lps:
            token = text(lp.token_id)
            tokens.append(token)
            offsets.append(c.offset)
            c.offset += len(token)
        return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
                "top_logprobs": [{text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
                                 for lp in lps],
                "text_offset": offsets}


class ChatRender(_Render):
    OBJECT, CHUNK_OBJECT = "chat.completion", "chat.completion.chunk"

    def _delta(self, index: int, c: _Choice, d: ChoiceDelta, prompt: int) -> dict[str, Any]:
        delta: dict[str, str] = {"role": "assistant", "content": d.text} if not c.started else {"content": d.text}
        lp = {"content": self._logprobs(d.logprobs)} if d.logprobs else None
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": None}

    def _whole(self, index: int, c: _Choice) -> dict[str, Any]:
        body = {"index": index, "message": {"role": "assistant", "content": "".join(c.text)},
                "logprobs": {"content": self._logprobs(c.logprobs)} if c.logprobs else None,
                "finish_reason": c.finish_reason}
        if self.return_token_ids:
            body["token_ids"] = c.token_ids
        return body

    def _logprobs(self, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
        return [dict(self._entry(lp.token_id, lp.logprob),
                     top_logprobs=[self._entry(t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)])
                for lp in lps]

    def _entry(self, token_id: int, logprob: float) -> dict[str, Any]:
        token = self.texts.text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}
