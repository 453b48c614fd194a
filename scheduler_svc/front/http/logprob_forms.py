"""Log-probabilities in the OpenAI API's two forms, and vLLM's prompt log-probs.

- completions: ``{tokens, token_logprobs, top_logprobs: [{text: logprob}], text_offset}``; each
  position's ``top_logprobs`` lists up to ``logprobs`` + 1 entries and always the sampled token
  (``logprobs: 0`` gives the sampled token's alone). Echoed prompt tokens come first; the first
  has no log-prob (``null``).
- chat: ``content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]``.
- ``prompt_logprobs`` (vLLM's extension): one entry per prompt token, ``null`` for the first, else
  ``{token_id: {logprob, rank, decoded_token}}`` for the prompt's token and its alternatives. The
  prompt token's rank is the executor's (``PromptLogprobs.token_ranks``: 1 + the tokens more
  likely, over the whole vocabulary, as vLLM ranks); from an executor that predates it, its rank
  among the top k, or ``null`` outside them (vLLM's ``Logprob.rank`` is optional), never a guess.

A token's text (``tokens``, ``token``, ``decoded_token``, the keys of ``top_logprobs``) is its id
decoded alone (``token_texts.py``): a piece of a character split over tokens reads U+FFFD. A token's
``bytes`` are those it adds to the text, so a choice's tokens' ``bytes``, concatenated, are its
content's UTF-8 (less a stop string cut off, or an EOS's text). ``text_offset`` is a token's
position, in characters, in the returned text: the length of the text its preceding tokens decode
to (a token that starts inside a character: that character's start), special tokens counting
nothing where the text skips them. Echoed prompt tokens are placed in the prompt's decoded text,
and the generated ones after the echo.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import Any

from pagedserve.engine_api import TokenLogprob
from scheduler_svc.front.http.token_texts import TokenTexts

Text = Callable[[int], str]


class TextOffsets:
    """Each token's ``text_offset``, token after token (a stream's chunks share one): the characters
    its preceding tokens' bytes decode to, counted as they come (a whole response's offsets are
    linear in its length). ``at``: where the first token starts; ``text_start``: the tokens begin
    the text (the decoder drops its leading spaces); ``skip_special``: the text leaves special tokens
    out."""

    __slots__ = ("at", "_texts", "_utf8", "_lead", "_skip")

    def __init__(self, texts: TokenTexts, at: int = 0, *, text_start: bool = False,
                 skip_special: bool = True) -> None:
        self.at = at
        self._texts = texts
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # holds an unfinished character back
        self._lead = texts.lead_spaces if text_start else 0
        self._skip = texts.special if skip_special else frozenset()

    def take(self, token_id: int) -> int:
        """Where ``token_id`` starts; then moves past it."""
        at = self.at
        if token_id in self._skip:
            return at
        raw = self._texts.bytes(token_id)
        if self._lead:
            kept = raw.lstrip(b" ")
            dropped = min(self._lead, len(raw) - len(kept))
            raw = raw[dropped:]
            self._lead = 0 if raw else self._lead - dropped
        self.at += len(self._utf8.decode(raw))
        return at


def completion_logprobs(texts: TokenTexts, lps: Sequence[TokenLogprob | None], offsets: TextOffsets,
                        token_ids: Sequence[int] | None = None) -> dict[str, Any]:
    """The completions form of ``lps`` (None: a position without log-probs, the prompt's first
    token, whose id is ``token_ids[i]``), placed in the text by ``offsets`` (which moves past them)."""
    text = texts.text
    tokens, values, tops, starts = [], [], [], []
    for i, lp in enumerate(lps):
        token_id = lp.token_id if lp is not None else token_ids[i]
        token = text(token_id)
        tokens.append(token)
        starts.append(offsets.take(token_id))
        if lp is None:
            values.append(None)
            tops.append(None)
            continue
        values.append(lp.logprob)
        top = {text(t): v for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)}
        top.setdefault(token, lp.logprob)  # the sampled token is always listed
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops, "text_offset": starts}


def chat_logprobs(texts: TokenTexts, lps: Sequence[TokenLogprob]) -> list[dict[str, Any]]:
    return [dict(_entry(texts, lp.token_id, lp.logprob),
                 top_logprobs=[_entry(texts, t, v) for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)])
            for lp in lps]


def _entry(texts: TokenTexts, token_id: int, logprob: float) -> dict[str, Any]:
    return {"token": texts.text(token_id), "logprob": logprob, "bytes": list(texts.bytes(token_id))}


def prompt_logprobs_body(text: Text, lps: Sequence[TokenLogprob | None]) -> list[dict[str, Any] | None]:
    out: list[dict[str, Any] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        ranked = sorted(zip(lp.top_token_ids, lp.top_logprobs, strict=True), key=lambda x: -x[1])
        entry = {str(t): {"logprob": v, "rank": r + 1, "decoded_token": text(t)} for r, (t, v) in enumerate(ranked)}
        if lp.rank is not None:  # the executor's: 1 + the tokens more likely, over the whole vocabulary
            entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": text(lp.token_id)}
        elif str(lp.token_id) not in entry:  # outside the top k, from an executor that reports no rank
            entry[str(lp.token_id)] = {"logprob": lp.logprob, "rank": None, "decoded_token": text(lp.token_id)}
        out.append(entry)
    return out
