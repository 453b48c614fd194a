"""The CPU executor: decode throughput per attention backend, decode attention against the GEMMs,
and the roofline of a decode step.

    .venv/bin/python -m benchmarks.executor_cpu [throughput] [--model DIR] [--batch-sizes 1,16,64]
        [--threads 2] [--cpu-attention torch,fused] [--repeats 3]
    .venv/bin/python -m benchmarks.executor_cpu attention [--help]   (benchmarks/executor_cpu_attention.py)
    .venv/bin/python -m benchmarks.executor_cpu roofline [--help]    (benchmarks/executor_cpu_roofline.py)

Each mode prints its table, then one JSON line. ``throughput`` (the default) is on the default
tiny model, per CPU attention backend:

Drives ``ModelRunner`` directly with plans (no transport): prefill every
sequence, then time ``--decode-steps`` steps that decode one token for each of
``batch`` sequences. Reports tokens/s and, from a ``torch.profiler`` pass over
a few more decode steps, the share of step time inside the linear layers'
matrix products (aten::mm/addmm) versus everything else (attention, norms,
rotary, sampling, batch building, Python). The attention share is the wall
time inside the backend's ``forward`` during the timed steps (no profiler).
Each batch size runs every backend of ``--cpu-attention`` (``torch``: gather +
SDPA; ``fused``: the C decode kernel, executor_svc/csrc) on the same model,
``--repeats`` times interleaved, and prints the median run and the
throughput ratio.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from executor_svc.attention import AttentionBackend
from executor_svc.backends import make_attention_backend
from executor_svc.kv_cache import KVCache
from executor_svc.model import load_model
from executor_svc.runner import ModelRunner
from executor_svc.sampler import Sampler
from pagedserve.wire import BatchPlan, NewSeq, SamplingParams, pack_ids

GEMM_OPS = ("aten::mm", "aten::addmm")
BLOCK = 16


def _runner(model, batch: int, max_len: int, backend: AttentionBackend) -> ModelRunner:
    per_seq = -(-max_len // BLOCK)
    kv = KVCache(model.cfg, BLOCK, batch * per_seq, 0, torch.float32)
    return ModelRunner(model, kv, backend, Sampler(seed=0))


SAMPLING = {
    "top-p": SamplingParams(temperature=0.8, top_p=0.95, seed=1),  # needs a full sort of the vocabulary
    "temperature": SamplingParams(temperature=0.8, seed=1),
    "greedy": SamplingParams(temperature=0.0),
}


def prefill(runner: ModelRunner, batch: int, prompt_len: int, max_len: int,
             sampling: SamplingParams = SAMPLING["top-p"]) -> None:
    per_seq = -(-max_len // BLOCK)
    vocab = runner.model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    news = [NewSeq(i, pack_ids(torch.randint(1, vocab, (prompt_len,), generator=g).tolist()), prompt_len,
                   list(range(i * per_seq, (i + 1) * per_seq)), 0, sampling) for i in range(batch)]
    per_step = max(1, 2048 // prompt_len)  # a token budget like the scheduler's
    for s in range(0, batch, per_step):
        ids = [n.seq_id for n in news[s:s + per_step]]
        res = runner.execute(BatchPlan(s, ids, [prompt_len] * len(ids), new_seqs=news[s:s + per_step]))
        assert res.error is None, res.error


def decode(runner: ModelRunner, batch: int, steps: int, step0: int) -> float:
    start = time.perf_counter()
    for k in range(steps):
        res = runner.execute(BatchPlan(step0 + k, list(range(batch)), [1] * batch))
        assert res.error is None and len(res.sampled_seq_ids) == batch, res.error
    return time.perf_counter() - start


def _gemm_share(runner: ModelRunner, batch: int, steps: int, step0: int) -> float:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        wall = decode(runner, batch, steps, step0)
    gemm_us = sum(e.self_cpu_time_total for e in prof.key_averages() if e.key in GEMM_OPS)
    return gemm_us / 1e6 / wall


class _TimedForward:
    """Wraps a backend and adds up the wall time of its ``forward`` (the whole attention of a layer:
    index building, gather and SDPA for torch; the kernel call for fused), with no profiler on."""

    def __init__(self, backend: AttentionBackend) -> None:
        self.backend, self.seconds = backend, 0.0

    def forward(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.backend.forward(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def __getattr__(self, name: str):
        return getattr(self.backend, name)


def bench(model, batch: int, prompt_len: int, steps: int, profile_steps: int, sampling: str,
          backend: AttentionBackend) -> dict:
    max_len = prompt_len + steps + profile_steps + 2
    timed = _TimedForward(backend)
    runner = _runner(model, batch, max_len, timed)  # type: ignore[arg-type]  # duck-typed backend
    prefill(runner, batch, prompt_len, max_len, SAMPLING[sampling])
    decode(runner, batch, 2, 10_000)  # warm-up
    timed.seconds = 0.0
    wall = decode(runner, batch, steps, 20_000)
    attn = timed.seconds / wall
    gemm = _gemm_share(runner, batch, profile_steps, 30_000)
    return {"batch": batch, "attention": backend.name, "sampling": sampling, "tokens_per_s": batch * steps / wall,
            "ms_per_step": 1000 * wall / steps, "gemm_fraction": gemm, "outside_gemm_fraction": 1 - gemm,
            "attention_fraction": attn}


MODES = ("throughput", "attention", "roofline")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    mode = argv.pop(0) if argv and argv[0] in MODES else "throughput"
    if mode == "throughput":
        result = throughput(argv)
    else:  # the other modes' modules load only when asked for
        module = importlib.import_module(f"benchmarks.executor_cpu_{mode}")
        ap = argparse.ArgumentParser(prog=f"python -m benchmarks.executor_cpu {mode}",
                                     description=module.__doc__.split("\n\n")[0])
        module.add_args(ap)
        result = module.run(ap.parse_args(argv))
    print(json.dumps(result))


def throughput(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.executor_cpu [throughput]",
                                 description="decode throughput per CPU attention backend")
    ap.add_argument("--model", help="HF model dir (default: build the default tiny llama in a temp dir)")
    ap.add_argument("--batch-sizes", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--profile-steps", type=int, default=8)
    ap.add_argument("--sampling", choices=tuple(SAMPLING), default="top-p")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--cpu-attention", default="torch,fused",
                    help="comma-separated backends to compare (torch, fused)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per backend and batch; the median is shown")
    ap.add_argument("--json", help="also write results here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from executor_svc.tiny_model import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "tiny", "llama", "default")
        model = load_model(model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model {model.cfg.architecture} {n_params / 1e6:.1f}M params, threads={torch.get_num_threads()}, "
          f"sampling={args.sampling}, prompt {args.prompt_len} tokens")
    backends = [make_attention_backend("cpu", name) for name in args.cpu_attention.split(",")]
    rows = []
    for b in (int(x) for x in args.batch_sizes.split(",")):
        runs: dict[str, list[dict]] = {be.name: [] for be in backends}
        for _ in range(args.repeats):  # interleaved, so load drift hits every backend alike
            for backend in backends:
                runs[backend.name].append(bench(model, b, args.prompt_len, args.decode_steps,
                                                args.profile_steps, args.sampling, backend))
        first = None
        for name, rs in runs.items():
            r = dict(sorted(rs, key=lambda x: x["tokens_per_s"])[len(rs) // 2])  # the median run
            r["runs_tokens_per_s"] = [round(x["tokens_per_s"], 1) for x in rs]
            rows.append(r)
            first = first or r
            print(f"batch {b:3d} {name:>9}: {r['tokens_per_s']:8.1f} tok/s "
                  f"({r['tokens_per_s'] / first['tokens_per_s']:.2f}x)  {r['ms_per_step']:7.2f} ms/step  "
                  f"GEMM {100 * r['gemm_fraction']:4.1f}%  outside GEMM {100 * r['outside_gemm_fraction']:4.1f}%  "
                  f"(attention {100 * r['attention_fraction']:4.1f}%)  runs {r['runs_tokens_per_s']}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return {"rows": rows}


if __name__ == "__main__":
    main()
