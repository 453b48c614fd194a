"""CPU cost of incremental detokenization per token, with and without the token-text table.

Feeds the same ids through :class:`IncrementalDetokenizer` twice, side by side:
every token through ``DecodeStream``, and with :func:`standalone_token_texts`
(plain tokens looked up). Two inputs: English text (this repository's README and
ARCHITECTURE, encoded), and uniformly random ids, which is what
``benchmarks.sim_executor`` samples (in a byte-level vocabulary a quarter of them
are lone bytes of multi-byte characters, which the table cannot take). The
tokenizer is the tiny model's (byte-level BPE). Medians of ``--repeats`` runs.

    .venv/bin/python -m benchmarks.detokenize [--repeats 5]

The last line printed is JSON: ``us_per_token_{text,random}_{stream,table}``.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from benchmarks.engine_harness import small_tokenizer
from scheduler_svc.front.output.detokenize import (
    NO_STANDALONE_TEXTS,
    IncrementalDetokenizer,
    standalone_token_texts,
)

ROOT = Path(__file__).resolve().parent.parent


def us_per_token(tok, ids: list[int], table) -> float:
    d = IncrementalDetokenizer(tok, ids[:2], standalone=table)
    t0 = time.perf_counter()
    for i in ids:
        d.step(i)
    return (time.perf_counter() - t0) / len(ids) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    tok, _ = small_tokenizer()
    t0 = time.perf_counter()
    table = standalone_token_texts(tok)
    built_ms = (time.perf_counter() - t0) * 1e3
    text = (ROOT / "README.md").read_text() + (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    english = tok.encode(text, add_special_tokens=False).ids
    rnd = random.Random(0)
    inputs = {"text": english, "random": [rnd.randrange(tok.get_vocab_size()) for _ in english]}
    summary: dict[str, float] = {}
    print(f"table: {len(table.texts)} of {tok.get_vocab_size()} tokens, built in {built_ms:.1f} ms")
    print(f"{'input':<8} {'tokens':>7} {'DecodeStream us':>16} {'table us':>9} {'ratio':>6}")
    for name, ids in inputs.items():
        runs: dict[str, list[float]] = {"stream": [], "table": []}
        for _ in range(args.repeats):  # alternating, so both see the same machine
            runs["stream"].append(us_per_token(tok, ids, NO_STANDALONE_TEXTS))
            runs["table"].append(us_per_token(tok, ids, table))
        med = {k: statistics.median(v) for k, v in runs.items()}
        for k, v in med.items():
            summary[f"us_per_token_{name}_{k}"] = round(v, 3)
        print(f"{name:<8} {len(ids):>7} {med['stream']:>16.3f} {med['table']:>9.3f} "
              f"{med['stream'] / med['table']:>5.1f}x")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
