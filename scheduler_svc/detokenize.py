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
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

# Prompt tokens given to the decoder as context: enough for decoders whose
# output for a token depends on its neighbours (SentencePiece's leading space).
PROMPT_CONTEXT_TOKENS = 6


class StopStringBuffer:
    """Releases text that cannot be part of a stop string; finds the first stop."""

    __slots__ = ("_stops", "_held", "matched")

    def __init__(self, stops: Sequence[str]) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._stops = tuple(stops)
        self._held = ""  # a suffix of the text so far that may start a stop string
        self.matched: str | None = None

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
            return held[:cut]
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
    Invariant: the concatenated deltas plus :meth:`finish` equal
    ``tokenizer.decode(output_ids)`` cut before the first stop string.
    """

    __slots__ = ("_tok", "_stream", "_skip", "_stops", "_has_stops", "_ids", "_emitted", "_finished")

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int] = (),
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(ids=context, skip_special_tokens=skip_special_tokens)
        self._stops = StopStringBuffer(stop)
        self._has_stops = bool(stop)
        self._ids = context  # prompt context, then every id fed (finish() decodes the tail)
        self._emitted = len(context)  # ids[:emitted] are text already
        self._finished = False

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
        ids = self._ids
        ids.append(token_id)
        chunk = self._stream.step(self._tok, token_id)
        if chunk is None:  # an incomplete character, or a skipped special token
            return ""
        self._emitted = len(ids)
        if not self._has_stops:  # (this runs for every token of every sequence)
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
