"""Each token id's text and bytes, as the log-probs forms name them (one table per model).

- ``text(id)``: the id decoded alone, special tokens included (a piece of a character that spans
  several tokens decodes to U+FFFD).
- ``bytes(id)``: the bytes the token adds to a text, so that a sequence's tokens, concatenated,
  give its text's UTF-8 (what OpenAI's ``bytes`` field is for: rebuilding a character split over
  tokens). Read off the token's vocabulary spelling where the decoder says how: byte-level BPE
  (GPT-2's byte alphabet) and SentencePiece (``▁`` is a space; ``<0xNN>``, byte fallback's
  tokens, the byte NN). Added tokens, and every token of another decoder, give their text's UTF-8.
- ``lead_spaces``: spaces the decoder drops at the very start of a text (SentencePiece's prefix
  space), which a token's bytes keep.
- ``special``: the ids a text decoded with ``skip_special_tokens`` leaves out.

Both caches are bounded: a vocabulary can hold hundreds of thousands of ids.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable

from tokenizers import Tokenizer

_CACHED_IDS = 1 << 16
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
Spelling = Callable[[str], bytes]


class TokenTexts:
    """Each token id's own text and bytes (cached: logprobs name the same ids over and over)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        added = tokenizer.get_added_tokens_decoder()
        self.special = frozenset(i for i, t in added.items() if t.special)
        self._added = frozenset(added)
        self._tok = tokenizer
        self._spell, self.lead_spaces = decoder_spelling(tokenizer)
        self.text = functools.lru_cache(maxsize=_CACHED_IDS)(
            lambda token_id: tokenizer.decode([token_id], skip_special_tokens=False))
        self.bytes = functools.lru_cache(maxsize=_CACHED_IDS)(self._bytes)

    def _bytes(self, token_id: int) -> bytes:
        piece = self._tok.id_to_token(token_id) if token_id not in self._added else None
        if piece is None or self._spell is None:
            return self.text(token_id).encode("utf-8")
        return self._spell(piece)


def decoder_spelling(tokenizer: Tokenizer) -> tuple[Spelling | None, int]:
    """(a vocabulary spelling -> its bytes, or None for a decoder of another kind; the spaces the
    decoder drops at a text's start). Only decoders whose output is the concatenation of per-token
    bytes qualify."""
    decoder = tokenizer.decoder
    if decoder is None:
        return None, 0
    spec = json.loads(decoder.__getstate__())
    steps = spec["decoders"] if spec.get("type") == "Sequence" else [spec]
    if [s.get("type") for s in steps] == ["ByteLevel"]:
        return _byte_level, 0
    return _sentencepiece(steps)


@functools.cache
def _gpt2_bytes() -> dict[str, int]:
    """GPT-2's byte alphabet, read back: each printable stand-in -> the byte it spells."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    extra = [b for b in range(256) if b not in keep]
    return {**{chr(b): b for b in keep}, **{chr(256 + i): b for i, b in enumerate(extra)}}


def _byte_level(piece: str) -> bytes:
    alphabet = _gpt2_bytes()
    if all(c in alphabet for c in piece):
        return bytes(alphabet[c] for c in piece)
    return piece.encode("utf-8")  # (the ByteLevel decoder passes such a token through as it is)


def _sentencepiece(steps: list[dict]) -> tuple[Spelling | None, int]:
    """SentencePiece's decoders: Replace (of a string), Metaspace, ByteFallback, Fuse, and Strip of
    leading spaces once the tokens are fused (it then cuts the text, not each token)."""
    replaces: list[tuple[str, str]] = []
    byte_fallback = fused = False
    lead = 0
    for s in steps:
        kind = s.get("type")
        if kind == "Replace" and "String" in s.get("pattern", {}):
            replaces.append((s["pattern"]["String"], s["content"]))
        elif kind == "Metaspace":
            replaces.append((s.get("replacement", "▁"), " "))
            lead += int(s.get("prepend_scheme", "always") != "never")  # (its first token's space)
        elif kind == "ByteFallback":
            byte_fallback = True
        elif kind == "Fuse":
            fused = True
        elif kind == "Strip" and fused and s.get("content") == " " and not s.get("stop"):
            lead += s.get("start", 0)
        else:
            return None, 0
    if not replaces:
        return None, 0

    def spell(piece: str) -> bytes:
        if byte_fallback and (m := _BYTE_TOKEN.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        for old, new in replaces:
            piece = piece.replace(old, new)
        return piece.encode("utf-8")

    return spell, lead
