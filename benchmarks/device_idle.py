"""How long the device waits per step inside the executor (plan ready, nothing else to wait for):
the command line of ``testing/device_idle.py``'s measurement.

    .venv/bin/python -m benchmarks.device_idle --model DIR [--device cuda] [--seqs 64] [--prepare-ahead] [--graphs]

``make gpu-check`` runs the same measurement on the GPU (benchmarks/kernels/gpu_check.py). Prints
one JSON line: wall and busy ms per step, idle ms per step and idle fraction.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from testing.device_idle import measure


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prepare-ahead", action="store_true", help="two plans in flight through a StepPipeline "
                    "(greedy steps chained on the device, as the executor runs on CUDA)")
    ap.add_argument("--graphs", action="store_true", help="decode steps replay CUDA graphs (on CPU their eager twin)")
    a = ap.parse_args(argv)
    print(json.dumps(measure(a.model, a.device, a.seqs, a.prompt, a.steps, prepare_ahead=a.prepare_ahead,
                             graphs=a.graphs)))


if __name__ == "__main__":
    main()
