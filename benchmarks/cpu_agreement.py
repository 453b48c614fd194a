"""Teacher-forced top-1 agreement of the CPU weight formats with float32 transformers.

    .venv/bin/python -m benchmarks.cpu_agreement [--model DIR] [--formats bfloat16,int8]
        [--prompts 20] [--steps 100] [--seed 1] [--train-steps 500]

The measurement (teacher forcing, what is scored, why ``--train-steps``) is described and
implemented in ``testing/cpu_agreement.py``; this script is its command line and report.
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
