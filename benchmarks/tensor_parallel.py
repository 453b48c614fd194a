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
from pathlib import Path

import torch

from benchmarks.executor_cpu import SAMPLING, decode, prefill
from pagedserve.envargs import parse_bytes
from testing.tensor_parallel import memory_rows, serving_runner

BLOCK = 16


class _TimedAllReduce:
    """Stands in for rank 0's model process group: the wall time spent in its collectives (waiting
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

    def allgather(self, outputs, inputs):  # (CPU ranks sum in rank order: TPGroup.all_reduce)
        start = time.perf_counter()
        self.pg.allgather(outputs, inputs).wait()
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
    print(json.dumps({"memory": mem, "throughput": tput}))


if __name__ == "__main__":
    main()
