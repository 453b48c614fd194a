"""xgrammar and llguidance side by side: what choosing the executors' grammar engine rested on.

For one JSON schema (``$ref``, ``enum``, ``anyOf``, bounded numbers, strings and arrays) and the
tiny model's 8K vocabulary and a 128K one (benchmarks/large_vocab.py): building each engine's view
of the vocabulary, compiling the schema, and, over a walk of 100 tokens drawn among those each
mask allows, the mean time to fill one sequence's mask and to advance its matcher by one token.
One thread, no batching: per sequence, per step. Also each package's import time (a fresh
interpreter) and whether it imports torch.

    .venv/bin/python -m benchmarks.grammar_engines

Prints one JSON line per (engine, vocabulary), then the imports.
"""

from __future__ import annotations

import json
import random
import statistics
import subprocess
import sys
import time

import numpy as np

SCHEMA = {
    "$defs": {"addr": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                        "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                       "required": ["city", "zip"], "additionalProperties": False}},
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 20}, "kind": {"enum": ["a", "b", "c"]},
                   "score": {"type": "number", "minimum": 0, "maximum": 1},
                   "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "minItems": 1, "maxItems": 4},
                   "home": {"$ref": "#/$defs/addr"},
                   "alt": {"anyOf": [{"type": "integer", "minimum": -5, "maximum": 5}, {"type": "boolean"}]}},
    "required": ["name", "kind", "score", "tags", "home", "alt"], "additionalProperties": False}
STEPS = 100


def _allowed(mask_row: np.ndarray, vocab: int) -> np.ndarray:
    return np.nonzero(np.unpackbits(mask_row.view(np.uint8), bitorder="little")[:vocab])[0]


def _walk(fill, accept, vocab: int, eos: int) -> tuple[float, float, int]:
    """Mean seconds per mask fill and per accept over a walk of allowed tokens (ends at EOS)."""
    rng = random.Random(0)
    fills, accepts = [], []
    for _ in range(STEPS):
        t = time.perf_counter()
        row = fill()
        fills.append(time.perf_counter() - t)
        allowed = _allowed(row, vocab)
        tok = int(allowed[rng.randrange(len(allowed))])
        t = time.perf_counter()
        accept(tok)
        accepts.append(time.perf_counter() - t)
        if tok == eos:
            break
    return statistics.mean(fills), statistics.mean(accepts), len(fills)


def xgrammar_costs(tok, vocab: int, eos: int) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok), vocab_size=vocab,
                                              stop_token_ids=[eos])
    vocab_s = time.perf_counter() - t
    t = time.perf_counter()
    compiled = xgr.GrammarCompiler(info, max_threads=1).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False)
    compile_s = time.perf_counter() - t
    matcher, mask = xgr.GrammarMatcher(compiled), xgr.allocate_token_bitmask(1, vocab)

    def fill():
        matcher.fill_next_token_bitmask(mask, 0)
        return mask[0].numpy()

    fill_s, accept_s, n = _walk(fill, matcher.accept_token, vocab, eos)
    return {"vocab_s": vocab_s, "compile_ms": 1e3 * compile_s, "mask_us": 1e6 * fill_s, "accept_us": 1e6 * accept_s,
            "tokens": n}


def llguidance_costs(tok, vocab: int, eos: int) -> dict:
    import llguidance as llg
    import llguidance.numpy as lnp

    t = time.perf_counter()
    lltok = llg.LLTokenizer(tok.to_str(), n_vocab=vocab, eos_token=eos)
    vocab_s = time.perf_counter() - t
    grammar = llg.LLMatcher.grammar_from_json_schema(SCHEMA, defaults={"whitespace_flexible": False})
    t = time.perf_counter()
    matcher = llg.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t
    mask = lnp.allocate_token_bitmask(1, vocab)

    def fill():
        lnp.fill_next_token_bitmask(matcher, mask, 0)
        return mask[0]

    fill_s, accept_s, n = _walk(fill, matcher.consume_token, vocab, eos)
    return {"vocab_s": vocab_s, "compile_ms": 1e3 * compile_s, "mask_us": 1e6 * fill_s, "accept_us": 1e6 * accept_s,
            "tokens": n}


def import_cost(module: str) -> dict:
    code = (f"import sys, time; t = time.perf_counter(); import {module}; "
            f"print(time.perf_counter() - t, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    return {"module": module, "import_s": round(float(out[0]), 2), "imports_torch": out[1] == "True"}


def main() -> None:
    import torch

    from benchmarks.large_vocab import large_tokenizer
    from executor_svc.tiny_model import EOS_TOKEN, train_tokenizer

    torch.set_num_threads(1)
    for tok in (train_tokenizer(8192), large_tokenizer()):
        vocab, eos = tok.get_vocab_size(), tok.token_to_id(EOS_TOKEN)
        for name, costs in (("xgrammar", xgrammar_costs), ("llguidance", llguidance_costs)):
            r = costs(tok, vocab, eos)
            print(json.dumps({"engine": name, "vocab": vocab, **{k: round(v, 3) for k, v in r.items()}}), flush=True)
    for module in ("xgrammar", "llguidance"):
        print(json.dumps(import_cost(module)), flush=True)


if __name__ == "__main__":
    main()
