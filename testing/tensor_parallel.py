"""A tensor-parallel group of the CPU executor, started as the executor starts one, and what each
rank's shard holds: used by ``benchmarks/tensor_parallel.py``, ``make gpu-check``'s N = 2 case
(``testing/kernels/tp_check.py``) and the tests."""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import torch

from executor_svc.kv_cache import KVCache
from executor_svc.model import load_model, load_model_config
from executor_svc.parallel.shard import TPShard

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
    plain runner). The other ranks run ``threads // n`` torch threads each."""
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
