"""Incremental detokenization with stop strings, one object per sequence.

The engine feeds each generated token to :meth:`IncrementalDetokenizer.step`
and streams the returned text delta. Two things hold text back:

- ``tokenizers.decoders.DecodeStream`` emits nothing until the bytes so far
  form whole UTF-8 characters (a character can span several byte-level tokens);
- :class:`StopStringBuffer` keeps any suffix that could be the start of a stop
  string until the next text tells whether it is one.

When a stop string matches, the text before it is released, the stop string
and everything after it are dropped, and ``stop_matched`` names it so the
engine finishes the sequence with FinishReason.STOP. When a sequence ends for
another reason the engine calls :meth:`finish` to release what is held.

Most tokens' text does not depend on their neighbours: once the text so far
ends on a whole character, such a token adds exactly its own text. Those
tokens are looked up in a table built once per tokenizer
(:func:`standalone_token_texts`) instead of going through ``DecodeStream``,
which decodes a window of ids twice per token (a table hit costs a seventh of
a ``DecodeStream.step``; this runs for every token of every sequence). The
table is built only for decoders known to have that property, and each entry
is checked against two different left neighbours.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import json
import re
from collections.abc import Mapping, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens given to the decoder as context: enough for decoders whose
# output for a token depends on its neighbours (SentencePiece's leading space).
PROMPT_CONTEXT_TOKENS = 6

# Decoders that map each token to text on its own, apart from the very first token of a
# decode (Metaspace and Strip drop its leading space: a generated token always follows
# context) and from byte-fallback tokens (<0xE2> joins its neighbours; they are left out).
_PER_TOKEN_DECODERS = frozenset({"ByteLevel", "Metaspace", "Replace", "ByteFallback", "Fuse", "Strip"})
_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")


@dataclasses.dataclass(frozen=True, slots=True, eq=False)
class StandaloneTexts:
    """What :class:`IncrementalDetokenizer` may look up instead of decoding (one per tokenizer)."""

    texts: Mapping[int, str]  # token id -> the text it adds after text ending on a whole character
    joining: frozenset[int]  # byte-fallback tokens: the next byte token may join them into a character


NO_STANDALONE_TEXTS = StandaloneTexts({}, frozenset())


def standalone_token_texts(tokenizer: Tokenizer) -> StandaloneTexts:
    """The tokens whose text does not depend on their neighbours, with that text.

    Empty when the tokenizer's decoder is not one whose output is known to be the
    concatenation of per-token texts. Added (special) tokens, byte-fallback tokens and
    tokens that are not whole characters on their own are never in it. Built with two
    batched decodes of the vocabulary, once per engine.
    """
    decoder = tokenizer.decoder
    if decoder is None or not _per_token(json.loads(decoder.__getstate__())):
        return NO_STANDALONE_TEXTS
    added = set(tokenizer.get_added_tokens_decoder())
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    joining = frozenset(i for t, i in vocab.items() if _BYTE_TOKEN.fullmatch(t))
    ids = sorted(i for i in vocab.values() if i not in added and i not in joining)
    anchors = list(itertools.islice((i for i in ids if _whole(tokenizer.decode([i]))), 2))
    if len(anchors) < 2:
        return NO_STANDALONE_TEXTS
    texts: dict[int, str] | None = None
    for anchor in anchors:  # an entry must read the same after either neighbour
        before = tokenizer.decode([anchor])
        seen = {}
        for i, full in zip(ids, tokenizer.decode_batch([[anchor, i] for i in ids]), strict=True):
            if full.startswith(before) and _whole(text := full[len(before):]):
                seen[i] = text
        texts = seen if texts is None else {i: t for i, t in texts.items() if seen.get(i) == t}
    return StandaloneTexts(texts or {}, joining)


def _per_token(spec: dict) -> bool:
    kind = spec.get("type")
    if kind == "Sequence":
        return all(_per_token(d) for d in spec.get("decoders", ()))
    if kind == "Strip" and spec.get("stop"):  # trims the end: the last token reads differently
        return False
    return kind in _PER_TOKEN_DECODERS


def _whole(text: str) -> bool:
    """Non-empty and free of U+FFFD (what an incomplete UTF-8 character decodes to)."""
    return bool(text) and "\ufffd" not in text


class StopStringBuffer:
    """Releases text that cannot be part of a stop string; finds the first stop. ``include_stop``:
    a matched stop string is released with the text before it (vLLM's include_stop_str_in_output)."""

    __slots__ = ("_stops", "_held", "matched", "_include")

    def __init__(self, stops: Sequence[str], include_stop: bool = False) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._held = ""  # a suffix of the text so far that may start a stop string
        self.matched: str | None = None
        self._include = include_stop

    def push(self, text: str) -> str:
        """Add ``text``; return what may be emitted now (never past a stop string)."""
        if self.matched is not None:
            raise RuntimeError("StopStringBuffer.push after a stop string matched: the sequence is finished")
        if not self._stops:
            return text
        held = self._held + text
        cut, stop = self._first_match(held)
        if stop is not None:
            self.matched, self._held = stop, ""
            return held[:cut + len(stop)] if self._include else held[:cut]
        keep = self._partial_start(held)
        self._held = held[keep:]
        return held[:keep]

    def flush(self) -> str:
        """Release the held text (the sequence ended without a stop string)."""
        out, self._held = self._held, ""
        return out

    def _first_match(self, text: str) -> tuple[int, str | None]:
        best, best_stop = len(text) + 1, None
        for stop in self._stops:
            i = text.find(stop)
            # Earliest start wins; at equal starts the longer stop (it is the one that matched fully).
            if i != -1 and (i < best or (i == best and len(stop) > len(best_stop))):
                best, best_stop = i, stop
        return best, best_stop

    def _partial_start(self, text: str) -> int:
        """Start of the longest suffix of ``text`` that is a proper prefix of some stop."""
        start = len(text)
        for stop in self._stops:
            i = text.find(stop[0], max(0, len(text) - len(stop) + 1), start)
            while i != -1:
                if stop.startswith(text[i:]):
                    start = i  # earliest such i for this stop; later stops may only do better
                    break
                i = text.find(stop[0], i + 1, start)
        return start


class IncrementalDetokenizer:
    """Turns one sequence's generated tokens into text deltas, honouring stop strings.

    ``prompt_token_ids``' last few ids give the decoder context, so the first
    generated token decodes as it would inside the full text.
    ``standalone``: :func:`standalone_token_texts` of ``tokenizer`` (by default none: every
    token goes through ``DecodeStream``); the deltas are the same either way.
    ``include_stop``: a matched stop string stays at the end of the text. ``min_tokens``: stop
    strings are looked for only in the text of the tokens after the first ``min_tokens`` (as
    vLLM does: before, the sequence cannot stop).
    Invariant: the concatenated deltas plus :meth:`finish` equal
    ``tokenizer.decode(output_ids)`` cut before the first stop string (after it, with ``include_stop``).
    """

    __slots__ = ("_tok", "_stream", "_skip", "_stops", "_has_stops", "_ids", "_emitted", "_finished",
                 "_texts", "_joining", "_whole", "_unchecked")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
        standalone: StandaloneTexts = NO_STANDALONE_TEXTS,
        include_stop: bool = False,
        min_tokens: int = 0,
    ) -> None:
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._stops = StopStringBuffer(stop, include_stop)
        self._has_stops = bool(stop)
        self._unchecked = min_tokens if stop else 0  # tokens whose text no stop string is looked for in
        self._ids = context  # prompt context, then every id fed (finish() decodes the tail)
        self._emitted = len(context)  # ids[:emitted] are text already
        self._finished = False
        self._texts, self._joining = standalone.texts, standalone.joining
        # The text so far ends on a whole character, after a token that joins nothing: a table
        # token adds just its text. (Table tokens are not fed to DecodeStream: its window then
        # lacks them, which changes nothing, as their text depends on no neighbour.) False until
        # the decoder first produced text: the prompt may end inside a character.
        self._whole = False

    @property
    def stop_matched(self) -> str | None:
        """The stop string that ended the sequence, or None."""
        return self._stops.matched

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def has_stops(self) -> bool:
        """Whether a stop string can end the sequence (then text is checked token by token)."""
        return self._has_stops

    def step(self, token_id: int) -> str:
        """Feed one generated token; return the text that may be streamed now.

        After a stop string matches (``stop_matched`` set) the sequence is done
        and further calls are a bug.
        """
        if self._finished:
            raise RuntimeError("IncrementalDetokenizer.step after the sequence finished")
        unchecked = self._unchecked
        if unchecked:  # min_tokens: this token's text cannot stop the sequence
            self._unchecked = unchecked - 1
        ids = self._ids
        ids.append(token_id)
        if not self._whole or (chunk := self._texts.get(token_id)) is None:
            chunk = self._stream.step(self._tok, token_id)
            if chunk is None:  # an incomplete character, or a skipped special token
                self._whole = False
                return ""
            self._whole = token_id not in self._joining
        self._emitted = len(ids)
        if not self._has_stops:  # (this runs for every token of every sequence)
            return chunk
        if unchecked:
            return chunk
        out = self._stops.push(chunk)
        if self._stops.matched is not None:
            self._finished = True
        return out

    def finish(self) -> str:
        """End the sequence (length, EOS, abort): release all text still held.

        Bytes of an incomplete character decode as U+FFFD, as in a full decode.
        Idempotent; returns "" once finished.
        """
        if self._finished:
            return ""
        self._finished = True
        out = ""
        if self._emitted < len(self._ids):
            tail = self._decode_tail()
            out = self._stops.push(tail) if tail else ""
            if self._stops.matched is not None:
                return out
        return out + self._stops.flush()

    def fork(self) -> IncrementalDetokenizer:
        """An independent copy (beam search and parallel sampling fork sequences)."""
        twin = copy.copy(self)
        twin._stream = copy.copy(self._stream)
        twin._stops = copy.copy(self._stops)
        twin._ids = list(self._ids)
        return twin

    def _decode_tail(self) -> str:
        """The text of the ids fed since the decoder last produced text, in context."""
        e = self._emitted
        context, pending = self._ids[max(0, e - PROMPT_CONTEXT_TOKENS):e], self._ids[e:]
        before = self._tok.decode(context, skip_special_tokens=self._skip)
        full = self._tok.decode(context + pending, skip_special_tokens=self._skip)
        if full.startswith(before):
            return full[len(before):]
        return self._tok.decode(pending, skip_special_tokens=self._skip)
