"""Requests' whole cost on the CPU executor: prefill every prompt, then decode, in CPU seconds.

    .venv/bin/python -m benchmarks.prefill_decode_cpu [--model DIR] [--batch-sizes 1,16]
        [--prompt-len 144] [--output-len 80] [--repeats 3]

``benchmarks.executor_cpu`` times decode steps alone; what prefill costs (its float32 GEMMs on the
C kernel, its attention on the paged kernel: one order of sums per row) shows only here. Drives
``ModelRunner`` with plans (no transport), one torch thread, and counts the CPU time of this
thread rather than wall time, so a shared, loaded machine skews it less. Prints the best of
``--repeats`` per batch size (output tokens per CPU second, prefill and decode milliseconds),
then one JSON line. Compare two trees by running it in each, back to back.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.executor_cpu import _runner, decode, prefill
from executor_svc.backends import make_attention_backend
from executor_svc.model import load_model


def measure(model, batch: int, prompt_len: int, output_len: int, repeats: int) -> tuple[float, float]:
    """Best (prefill, decode) CPU seconds over ``repeats`` fresh runners."""
    best: tuple[float, float] | None = None
    max_len = prompt_len + output_len + 4
    for _ in range(repeats):
        runner = _runner(model, batch, max_len, make_attention_backend("cpu", "fused"))
        c0 = time.thread_time()
        prefill(runner, batch, prompt_len, max_len)
        c1 = time.thread_time()
        decode(runner, batch, output_len, 100)
        run = (c1 - c0, time.thread_time() - c1)
        best = run if best is None or sum(run) < sum(best) else best
    assert best is not None
    return best


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF model dir (default: build the default tiny llama in a temp dir)")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--prompt-len", type=int, default=144)
    ap.add_argument("--output-len", type=int, default=80)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from executor_svc.tiny_model import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "tiny", "llama", "default")
        model = load_model(model_dir, "cpu", torch.float32)
        out = {}
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            tp, td = measure(model, batch, args.prompt_len, args.output_len, args.repeats)
            rate = batch * args.output_len / (tp + td)
            print(f"batch {batch}: {rate:.1f} output tokens per CPU s "
                  f"(prefill {tp * 1000:.0f} ms, decode {td * 1000:.0f} ms)", flush=True)
            out[f"b{batch}"] = {"tokens_per_cpu_s": round(rate, 1), "prefill_ms": round(tp * 1000, 1),
                                "decode_ms": round(td * 1000, 1)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
