"""Tensor parallelism on the CPU: memory per rank for N = 1, 2, 4 and decode tokens/s for N = 1, 2.

    .venv/bin/python -m benchmarks.tensor_parallel [--model DIR] [--sizes 1,2,4] [--throughput-sizes 1,2]
        [--batch 16] [--prompt-len 64] [--decode-steps 32] [--repeats 5] [--kv-budget 256MiB] [--quick]

Memory (measured on the loaded tensors, no forward): for each N, every rank's shard is loaded
with the executor's own loader (``load_model(shard=...)``) and its parameter bytes are summed,
split into decoder-layer weights (sharded) and the rest (embeddings, final norm, and the LM head
on rank 0); the KV pool a rank allocates for ``--kv-budget`` bytes is built with ``KVCache`` and
its bytes and block count reported (a rank caches only its own KV heads, so the same budget
holds N times the blocks, or the same blocks cost 1/N of the bytes).

Throughput: each group is started exactly as ``pagedserve-executor --tensor-parallel-size N``
starts one (``start_group`` + ``build_runner``: this process is rank 0, the followers are
``python -m executor_svc`` processes), then ``--batch`` sequences are prefilled and
``--decode-steps`` decode steps timed, N = 1 and N = 2 interleaved ``--repeats`` times; the
median run is shown. Every group gets the same cores: ``--threads`` torch threads in all, split
evenly over its ranks (default: all cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch

from benchmarks.executor_cpu import SAMPLING, decode, prefill
from executor_svc.kv_cache import KVCache
from executor_svc.model import load_model, load_model_config
from executor_svc.parallel.shard import TPShard
from pagedserve.envargs import parse_bytes

BLOCK = 16


def memory_rows(model_dir: Path, sizes: list[int], kv_budget: int) -> list[dict]:
    cfg = load_model_config(model_dir)
    rows = []
    for n in sizes:
        for rank in range(n):
            model = load_model(model_dir, shard=TPShard(rank, n))
            layers = sum(p.numel() * p.element_size() for name, p in model.named_parameters()
                         if name.startswith("layers."))
            total = sum(p.numel() * p.element_size() for p in model.parameters())
            kv = KVCache.from_budget(model.cfg, BLOCK, kv_budget, 0, torch.float32)
            rows.append({"tp": n, "rank": rank, "weight_bytes": total, "layer_weight_bytes": layers,
                         "other_weight_bytes": total - layers, "kv_heads": model.cfg.num_kv_heads,
                         "kv_bytes": kv.device_bytes, "kv_blocks": kv.num_blocks,
                         "kv_bytes_per_block": kv.device_bytes // kv.num_blocks})
            del model, kv
    full = next(r for r in rows if r["tp"] == 1) if 1 in sizes else None
    for r in rows:
        if full is not None:
            r["layer_fraction_of_full"] = r["layer_weight_bytes"] / full["layer_weight_bytes"]
    print(f"\nmemory per rank ({cfg.architecture}, {cfg.num_heads} q / {cfg.num_kv_heads} KV heads, "
          f"{cfg.num_layers} layers, float32; KV budget {kv_budget / 2**20:.0f} MiB per rank)")
    print("| N | rank | weights MiB | layer weights MiB | x full layers | other MiB | KV heads | "
          "KV bytes/block | KV blocks in budget |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tp']} | {r['rank']} | {r['weight_bytes'] / 2**20:.2f} | {r['layer_weight_bytes'] / 2**20:.2f} | "
              f"{r.get('layer_fraction_of_full', float('nan')):.3f} | {r['other_weight_bytes'] / 2**20:.2f} | "
              f"{r['kv_heads']} | {r['kv_bytes_per_block']} | {r['kv_blocks']} |")
    return rows


@contextmanager
def serving_runner(model_dir: Path, n: int, threads: int, kv: str = "64MiB", device: str = "cpu"):
    """Rank 0's runner of an N-rank group started the way the executor starts one (N = 1: the
    plain runner). The other ranks run ``threads // n`` torch threads each, as does this one."""
    from executor_svc.__main__ import build_runner
    from executor_svc.config import parse_config
    from executor_svc.parallel.serve import close_group, start_group

    per_rank = max(1, threads // n)
    argv = ["--model", str(model_dir), "--scheduler", "tcp://127.0.0.1:1", "--device", device,
            "--kv-cache-memory", kv, "--swap-space", "0", "--tensor-parallel-size", str(n),
            "--cpu-attention", "fused" if device == "cpu" else "auto", "--log-level", "WARNING"]
    os.environ["OMP_NUM_THREADS"] = str(per_rank)  # the followers' torch threads (read at their start)
    torch.set_num_threads(per_rank)
    cfg = parse_config(argv, environ={})
    group = start_group(cfg, argv) if n > 1 else None
    runner = None
    try:
        runner, _ = build_runner(cfg, group)
        yield runner
    finally:
        if group is not None:
            close_group(group, runner)


def _timed(runner, batch: int, prompt_len: int, steps: int, round_: int) -> float:
    """Prefill ``batch`` fresh sequences, time ``steps`` decode steps; tokens/s."""
    runner.reset()
    prefill(runner, batch, prompt_len, prompt_len + steps + 4, SAMPLING["greedy"])
    decode(runner, batch, 2, 1000 * round_)  # warm-up
    return batch * steps / decode(runner, batch, steps, 1000 * round_ + 10)


def throughput_rows(model_dir: Path, sizes: list[int], threads: int, batch: int, prompt_len: int, steps: int,
                    repeats: int) -> list[dict]:
    from contextlib import ExitStack

    runs: dict[int, list[float]] = {n: [] for n in sizes}
    with ExitStack() as stack:
        runners = {n: stack.enter_context(serving_runner(model_dir, n, threads)) for n in sizes}
        for round_ in range(repeats):  # interleaved: load drift on a shared machine hits every N alike
            for n, runner in runners.items():
                torch.set_num_threads(max(1, threads // n))
                runs[n].append(_timed(runner, batch, prompt_len, steps, round_ + 1))
    rows = [{"tp": n, "threads_per_rank": max(1, threads // n), "tokens_per_s": statistics.median(r),
             "runs": [round(x, 1) for x in r]} for n, r in runs.items()]
    base = rows[0]["tokens_per_s"]
    print(f"\nCPU decode throughput, batch {batch}, prompt {prompt_len}, {steps} steps, {threads} threads in all, "
          f"median of {repeats}")
    print("| N | threads per rank | tokens/s | vs N=1 | runs |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tp']} | {r['threads_per_rank']} | {r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x | "
              f"{r['runs']} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF model dir (default: the default tiny llama, built in a temp dir)")
    ap.add_argument("--sizes", default="1,2,4", help="tensor-parallel sizes for the memory table")
    ap.add_argument("--throughput-sizes", default="1,2", help="tensor-parallel sizes timed side by side")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads per group, in all")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--kv-budget", type=parse_bytes, default=parse_bytes("256MiB"), help="KV bytes per rank")
    ap.add_argument("--quick", action="store_true", help="3 repeats of 16 steps (make bench)")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.decode_steps = 3, 16
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else None
        if model_dir is None:
            from executor_svc.tiny_model import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "tiny", "llama", "default")
        mem = memory_rows(model_dir, [int(x) for x in args.sizes.split(",")], args.kv_budget)
        tput = throughput_rows(model_dir, [int(x) for x in args.throughput_sizes.split(",")], args.threads,
                               args.batch, args.prompt_len, args.decode_steps, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps({"memory": mem, "throughput": tput}, indent=2))


if __name__ == "__main__":
    main()
