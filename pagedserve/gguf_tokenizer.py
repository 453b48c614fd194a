"""A ``tokenizers.Tokenizer`` built from a GGUF file's vocabulary: no tokenizer.json needed.

llama.cpp stores the vocabulary (``tokenizer.ggml.tokens``, ``token_type``, ``merges`` or
``scores``) and names the kind of tokenizer (``tokenizer.ggml.model``) and its pre-tokenizer
(``tokenizer.ggml.pre``). Two kinds cover the architectures served here:

- ``gpt2``: byte-level BPE (Llama 3, Qwen2, SmolLM2). The pre-tokenizer's split follows
  ``tokenizer.ggml.pre`` as llama.cpp's ``llama-vocab.cpp`` does (SmolLM2's ``smollm`` splits
  digits one by one, as its own tokenizer.json does; transformers' GGUF converter leaves that
  out, so the two differ on numbers only).
- ``llama``: SentencePiece BPE with byte fallback (Llama 2, Mistral); merges are rebuilt from
  the token scores when the file has none, as transformers' ``generate_merges`` does.

Control tokens (type 3) are added as special tokens and user-defined ones (type 4) as plain
added tokens, so they are matched whole; BOS is prepended when ``add_bos_token`` says so.
"""

from __future__ import annotations

import functools
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

from pagedserve.gguf_file import GGUFError
from pagedserve.gguf_model import GGUFModel

_CONTROL, _USER_DEFINED = 3, 4
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> how llama.cpp splits text before BPE (llama-vocab.cpp), then byte-level
_BYTE_LEVEL = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
_GPT2 = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]  # GPT-2's own split
_SPLITS: dict[str, list[pre_tokenizers.PreTokenizer]] = {
    "default": _GPT2, "gpt-2": _GPT2,
    "smollm": [pre_tokenizers.Digits(individual_digits=True), *_GPT2],
    **{pre: [pre_tokenizers.Split(Regex(_LLAMA3), behavior="isolated"), _BYTE_LEVEL]
       for pre in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe")},
    **{pre: [pre_tokenizers.Split(Regex(_QWEN2), behavior="isolated"), _BYTE_LEVEL]
       for pre in ("qwen2", "deepseek-r1-qwen")},
}


@functools.cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of each byte (the byte-level BPE alphabet)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    extra = [b for b in range(256) if b not in keep]
    return {**{b: chr(b) for b in keep}, **{b: chr(256 + i) for i, b in enumerate(extra)}}


def build_tokenizer(model: GGUFModel) -> Tokenizer:
    meta = model.meta
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise GGUFError(f"{model.path}: no tokenizer.ggml.tokens (a GGUF without its vocabulary cannot be served)")
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = _byte_level(model, tokens)
    elif kind == "llama":
        tok = _sentencepiece(model, tokens)
    else:
        raise GGUFError(f"{model.path}: tokenizer.ggml.model {kind!r} is not supported (supported: gpt2, llama)")
    _add_special(tok, tokens, meta.get("tokenizer.ggml.token_type") or [], byte_level=kind == "gpt2")
    _add_bos(tok, model, tokens, default=kind == "llama")
    return tok


def _byte_level(model: GGUFModel, tokens: list[str]) -> Tokenizer:
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    # Tokens outside the byte alphabet (some control tokens) are spelled byte by byte, as transformers does.
    vocab = {t if set(t) <= letters else "".join(alphabet[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    merges = _merges(model)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
    pre = model.meta.get("tokenizer.ggml.pre", "default")
    splits = _SPLITS.get(pre)
    if splits is None:
        raise GGUFError(f"{model.path}: tokenizer.ggml.pre {pre!r} is not supported (supported: "
                        f"{', '.join(sorted(_SPLITS))})")
    tok.pre_tokenizer = pre_tokenizers.Sequence(splits)
    tok.decoder = decoders.ByteLevel()
    return tok


def _sentencepiece(model: GGUFModel, tokens: list[str]) -> Tokenizer:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = _merges(model) if "tokenizer.ggml.merges" in model.meta else _merges_from_scores(model, tokens)
    unk = model.meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True,
                               unk_token=tokens[unk] if isinstance(unk, int) and 0 <= unk < len(tokens) else None))
    prefix = model.meta.get("tokenizer.ggml.add_space_prefix", True)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if prefix else "never",
                                                 split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    tok.decoder = decoders.Sequence(steps + ([decoders.Strip(content=" ", left=1)] if prefix else []))
    return tok


def _merges(model: GGUFModel) -> list[tuple[str, str]]:
    out = []
    for m in model.meta.get("tokenizer.ggml.merges") or []:
        left, sep, right = m.partition(" ")
        if not sep:
            raise GGUFError(f"{model.path}: merge {m!r} is not two tokens separated by a space")
        out.append((left, right))
    return out


def _merges_from_scores(model: GGUFModel, tokens: list[str]) -> list[tuple[str, str]]:
    """SentencePiece files carry scores, not merges: every split of a token into two tokens is a
    merge, ranked by the merged token's score (transformers' generate_merges)."""
    scores = model.meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) != len(tokens):
        raise GGUFError(f"{model.path}: a llama tokenizer needs merges or one score per token")
    vocab = {t: i for i, t in enumerate(tokens)}
    found = []
    for token, score in zip(tokens, scores, strict=True):
        local = [(token[:k], token[k:], score) for k in range(1, len(token))
                 if token[:k] in vocab and token[k:] in vocab]
        found.extend(sorted(local, key=lambda x: (vocab[x[0]], vocab[x[1]])))
    found.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=True)
    return [(a, b) for a, b, _ in found]


def _add_special(tok: Tokenizer, tokens: list[str], types: list[Any], byte_level: bool) -> None:
    letters = set(_byte_alphabet().values()) if byte_level else None
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=False)
               if ty == _CONTROL and (letters is None or set(t) <= letters)]
    # (only those the vocabulary spells as stored: another would be added past the model's vocabulary)
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types, strict=False)
            if ty == _USER_DEFINED and tok.token_to_id(t) is not None]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)


def _add_bos(tok: Tokenizer, model: GGUFModel, tokens: list[str], default: bool) -> None:
    bos = model.meta.get("tokenizer.ggml.bos_token_id")
    if not model.meta.get("tokenizer.ggml.add_bos_token", default) or not isinstance(bos, int) \
            or not 0 <= bos < len(tokens):
        return
    name = tokens[bos]
    tok.post_processor = processors.TemplateProcessing(single=f"{name}:0 $A:0", pair=f"{name}:0 $A:0 $B:1",
                                                       special_tokens=[(name, bos)])
