"""Tokenizers built here, downloaded from nowhere, for tests and benchmarks.

:func:`small_tokenizer` is the small tiny model's (8K tokens). :func:`large_tokenizer` is a
byte-level BPE with a Llama-3-sized vocabulary (128K): what a grammar engine costs per token grows
with the vocabulary (its mask has a bit per token and it walks the token trie), so measuring it
needs a vocabulary of a real model's size; the tiny models' tokenizers have 512 and 8192 tokens.
It starts from the tiny model's trained BPE (trained on ``executor_svc/data/corpus.txt``) and keeps
adding merges of two existing tokens, drawn with a seeded generator, until the vocabulary has
``vocab_size`` tokens: the result is a valid BPE (every token is a merge of two tokens before it),
so ``tokenizers`` encodes and decodes with it and grammar engines read its token bytes as they
would a real model's. Token lengths follow the merges: most are 3-12 bytes, as in a trained 128K
vocabulary.
"""


import functools
import json
import random

LLAMA3_VOCAB = 128_256


def small_tokenizer():
    """The small tiny model's tokenizer and its EOS id."""
    from executor_svc.tiny_model import EOS_TOKEN, SIZES, train_tokenizer

    tok = train_tokenizer(SIZES["small"]["vocab"])
    return tok, tok.token_to_id(EOS_TOKEN)


@functools.lru_cache(maxsize=2)
def large_tokenizer_json(vocab_size: int = LLAMA3_VOCAB, seed: int = 0) -> str:
    from executor_svc.tiny_model import _trained_tokenizer_json

    spec = json.loads(_trained_tokenizer_json(8192))
    vocab: dict[str, int] = spec["model"]["vocab"]
    merges: list = spec["model"]["merges"]
    rng = random.Random(seed)
    tokens = [t for t in vocab if not t.startswith("<|")]
    words = [t for t in tokens if t.isalpha() or (t.startswith("Ġ") and t[1:].isalpha())]
    tails = [t for t in tokens if t.isalpha() and len(t) <= 4]
    while len(vocab) < vocab_size:
        left, right = rng.choice(words), rng.choice(tails)
        new = left + right
        if new in vocab or len(new) > 12:
            continue
        vocab[new] = len(vocab)
        merges.append([left, right])
        words.append(new)
    return json.dumps(spec)


def large_tokenizer(vocab_size: int = LLAMA3_VOCAB, seed: int = 0):
    """The tokenizer (``tokenizers.Tokenizer``); id 0 is ``<|endoftext|>``, its EOS."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(large_tokenizer_json(vocab_size, seed))
