"""Tensor parallelism on the CPU: memory per rank for N = 1, 2, 4 and decode tokens/s for N = 1, 2.

    .venv/bin/python -m benchmarks.tensor_parallel [--model DIR] [--sizes 1,2,4] [--configs 1x2,1x1,2x1]
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
``--decode-steps`` decode steps timed, every configuration (``--configs``: N ranks x torch
threads per rank) interleaved ``--repeats`` times; the median run is shown with the share of
rank 0's step time spent in the all-reduces (waiting for the other ranks included).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
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


class _TimedAllReduce:
    """Stands in for rank 0's model process group: the wall time spent in all-reduces (waiting
    for the other ranks included)."""

    class _Done:
        def wait(self) -> None:
            return None

    def __init__(self, pg) -> None:
        self.pg, self.seconds = pg, 0.0

    def allreduce(self, tensors):
        start = time.perf_counter()
        self.pg.allreduce(tensors).wait()
        self.seconds += time.perf_counter() - start
        return self._Done()


def _timed(runner, batch: int, prompt_len: int, steps: int, round_: int) -> tuple[float, float]:
    """Prefill ``batch`` fresh sequences, time ``steps`` decode steps: (tokens/s, share of the
    time rank 0 spent in all-reduces)."""
    runner.reset()
    prefill(runner, batch, prompt_len, prompt_len + steps + 4, SAMPLING["greedy"])
    decode(runner, batch, 2, 1000 * round_)  # warm-up
    timer = getattr(getattr(runner, "group", None), "model_pg", None)
    if isinstance(timer, _TimedAllReduce):
        timer.seconds = 0.0
    wall = decode(runner, batch, steps, 1000 * round_ + 10)
    return batch * steps / wall, (timer.seconds / wall if isinstance(timer, _TimedAllReduce) else 0.0)


def throughput_rows(model_dir: Path, configs: list[tuple[int, int]], batch: int, prompt_len: int, steps: int,
                    repeats: int) -> list[dict]:
    """configs: (N, torch threads per rank); the groups run side by side, interleaved."""
    from contextlib import ExitStack

    runs: dict[tuple[int, int], list[tuple[float, float]]] = {c: [] for c in configs}
    with ExitStack() as stack:
        runners = {}
        for n, per_rank in configs:  # one group per N; its followers keep the threads they started with
            if n not in runners:
                runners[n] = stack.enter_context(serving_runner(model_dir, n, n * per_rank))
        for runner in runners.values():
            if getattr(runner, "group", None) is not None:
                runner.group.model_pg = _TimedAllReduce(runner.group.model_pg)
        for round_ in range(repeats):  # interleaved: load drift on a shared machine hits every config alike
            for n, per_rank in configs:
                torch.set_num_threads(per_rank)
                runs[(n, per_rank)].append(_timed(runners[n], batch, prompt_len, steps, round_ + 1))
    rows = []
    for (n, per_rank), r in runs.items():
        median = sorted(r)[len(r) // 2]  # the median run (tokens/s), with its all-reduce share
        rows.append({"tp": n, "threads_per_rank": per_rank, "tokens_per_s": median[0],
                     "allreduce_fraction": median[1], "runs": [round(x[0], 1) for x in r]})
    base = rows[0]["tokens_per_s"]
    print(f"\nCPU decode throughput, batch {batch}, prompt {prompt_len}, {steps} steps, median of {repeats} "
          f"(load average before: {os.getloadavg()[0]:.1f})")
    print("| N | threads per rank | cores used | tokens/s | vs first row | rank 0 in all-reduce | runs |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['tp']} | {r['threads_per_rank']} | {r['tp'] * r['threads_per_rank']} | {r['tokens_per_s']:.1f} | "
              f"{r['tokens_per_s'] / base:.2f}x | {100 * r['allreduce_fraction']:.0f}% | {r['runs']} |")
    return rows


def _configs(text: str) -> list[tuple[int, int]]:
    """``1x2,2x1`` -> [(1, 2), (2, 1)]: N ranks x torch threads per rank."""
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",")]  # type: ignore[misc]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", help="HF model dir (default: the default tiny llama, built in a temp dir)")
    ap.add_argument("--sizes", default="1,2,4", help="tensor-parallel sizes for the memory table")
    cores = os.cpu_count() or 1
    ap.add_argument("--configs", type=_configs, default=_configs(f"1x{cores},1x1,2x{max(1, cores // 2)}"),
                    help="groups timed side by side, as N x torch threads per rank (default: one rank on "
                         "every core, one rank on one core, two ranks sharing the cores)")
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
        tput = throughput_rows(model_dir, args.configs, args.batch, args.prompt_len, args.decode_steps, args.repeats)
    if args.json:
        Path(args.json).write_text(json.dumps({"memory": mem, "throughput": tput}, indent=2))


if __name__ == "__main__":
    main()
