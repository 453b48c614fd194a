"""Teacher-forced top-1 agreement of the CPU weight formats with float32 transformers.

    .venv/bin/python -m benchmarks.cpu_agreement [--model DIR] [--formats bfloat16,int8]
        [--prompts 20] [--steps 100] [--seed 1] [--train-steps 500]

transformers' float32 model generates ``--steps`` greedy tokens after each of ``--prompts``
random prompts (seeded by ``--seed``; tuning used seed 0, reported figures use other seeds).
Our model, loaded in each format, is then fed exactly those tokens (teacher forcing: its own
choices never feed back), all prompts as one decode batch, through the CPU fast path (the
fused decode stack, the KV cache in the format's dtype). At every step it is scored on
whether its top-1 token is the one transformers chose; the largest absolute logit difference
is reported too. ``prompts x steps`` decode steps in all (default 2,000). Float32 is included
as the reference point of the measurement itself, and ``transformers-bf16`` (transformers'
model in bfloat16, fed the same tokens) as the reference point of what bfloat16 costs.

The random-weight models' next-token distributions are nearly flat (logits spread ~2), so
rounding alone flips many choices, whatever the format's implementation. ``--train-steps N``
first trains the checkpoint (from its random weights) for N steps on the tiny model's corpus, so
that it predicts as a trained model does, with clear margins between its first choices; the
agreement is then measured on the trained weights, with the same random prompts.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from testing.cpu_agreement import run, train


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="HF checkpoint (default: the default tiny llama)")
    ap.add_argument("--formats", default="float32,bfloat16,int8,transformers-bf16")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--train-steps", type=int, default=0,
                    help="train the checkpoint on the tiny model's corpus this many steps first (~1.5 s each)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from executor_svc.tiny_model import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "tiny", "llama", "default")
        if args.train_steps:
            model_dir = train(Path(model_dir), Path(tmp) / "trained", args.train_steps)
        results = run(model_dir, args.formats.split(","), args.prompts, args.steps, args.seed)
    for r in results:
        print(f"{r.fmt:9} top-1 agreement {r.agree}/{r.steps} = {r.rate:.2%}, max |logit diff| {r.max_logit_diff:.4g}")
    print(json.dumps({f"agreement_{r.fmt}": round(r.rate, 4) for r in results}
                     | {f"max_logit_diff_{r.fmt}": round(r.max_logit_diff, 4) for r in results}))


if __name__ == "__main__":
    main()
