"""Candidate CPU kernels for the executor's linear layers, side by side, against memory bandwidth.

    .venv/bin/python -m benchmarks.cpu_linear_kernels [--threads 2] [--rows 1,16,48] [--repeats 7]
        [--size default|500mb] [--isa avx512|avx2|scalar] [--variant NAME=FLAGS ...]

One "step" is every linear layer of a Llama-shaped model (default: the default tiny model's
8 layers of fused q/k/v, o, gate/up and down projections plus the LM head, 32M weights; with
``--size 500mb`` about 125M) applied to ``rows`` token rows, each layer with its own weights,
so a step reads every weight once from memory, as a decode step does. For each weight format
the candidates are timed in the same process, interleaved, median of ``--repeats``:

* float32: torch ``F.linear`` (MKL), oneDNN's linear (``mkldnn::_linear_pointwise``), our C kernel
  (``csrc/linear_cpu.c``), which serves every row count
* bfloat16: torch ``F.linear`` on bfloat16 inputs (oneDNN), ours (AVX-512 BF16 / AVX2)
* int8: torch ``_weight_int8pack_mm`` (weight-only, per channel), torch's dynamic quantized
  linear (fbgemm), ours (VNNI / AVX2)

``--variant t0=-DPS_PF_HINT=_MM_HINT_T0`` adds our kernels built again with those compiler flags
(a build-time choice such as the prefetch hint in ``csrc/linear_x86.c``) as one more candidate
per format, timed interleaved with the others.

Before them it measures the machine's read bandwidth (``ps_read_sum``: a STREAM-style read of
an array 4x the last-level cache, same threads) and reports each candidate's weight bytes per
second against it. A table, then one JSON line.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import shlex
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from executor_svc.cpu_kernels import build_with_flags
from executor_svc.cpu_ops import CpuOps, native_ops
from executor_svc.model import weights
from executor_svc.model.weights import PackedLinear, quantize_int8

SIZES = {  # hidden, intermediate, layers, heads, kv heads, vocab
    "default": (512, 1408, 8, 8, 4, 8192),
    "500mb": (1024, 2816, 10, 16, 8, 8192),
}


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


def shapes(size: str) -> list[tuple[int, int]]:
    """(out, in) of every linear layer of one step."""
    h, inter, layers, heads, kvh, vocab = SIZES[size]
    hd = h // heads
    per_layer = [((heads + 2 * kvh) * hd, h), (h, h), (2 * inter, h), (h, inter)]
    return per_layer * layers + [(vocab, h)]


def variant_builds(specs: list[str]) -> dict[str, CpuOps]:
    """``NAME=FLAGS`` specs -> our kernels built with each (in a temporary directory)."""
    into = Path(tempfile.mkdtemp(prefix="ps-variants-")) if specs else Path()
    out = {}
    for name, _, flags in (v.partition("=") for v in specs):
        build = build_with_flags(shlex.split(flags), into / f"variant-{name}.so")
        out[name] = CpuOps(ctypes.CDLL(str(build.path)), str(build.path))
    return out


def candidates(ws: list[torch.Tensor], ops, variants: dict[str, CpuOps] | None = None) -> dict[str, list]:
    """Per format, (name, [callables per layer]) of each candidate."""
    out: dict[str, list] = {"float32": [], "bfloat16": [], "int8": []}
    out["float32"].append(("torch F.linear (MKL)", [lambda x, w=w: F.linear(x, w) for w in ws]))
    if weights.ONEDNN_LINEAR is not None:
        out["float32"].append(("oneDNN (mkldnn linear)", [lambda x, w=w: weights.ONEDNN_LINEAR(x, w, None, "none", [], "")
                                                          for w in ws]))
    f32 = [PackedLinear.from_float(w, None, "float32", ops) for w in ws]
    out["float32"].append(("C kernel", [p.on_kernel for p in f32]))
    wb = [w.bfloat16() for w in ws]
    out["bfloat16"].append(("torch F.linear bf16", [lambda x, w=w: F.linear(x.bfloat16(), w).float() for w in wb]))
    out["bfloat16"].append(("ours", [PackedLinear.from_float(w, None, "bfloat16", ops) for w in ws]))
    q = [quantize_int8(w) for w in ws]
    out["int8"].append(("torch _weight_int8pack_mm",
                        [lambda x, qi=qi: torch.ops.aten._weight_int8pack_mm(x, qi[0], qi[1]) for qi in q]))
    try:
        from torch.ao.nn.quantized.dynamic import Linear as DynLinear

        dyn = []
        for w in ws:
            lin = torch.nn.Linear(w.shape[1], w.shape[0], bias=False)
            lin.weight.data.copy_(w)
            lin.qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
            dyn.append(DynLinear.from_float(lin))
        out["int8"].append(("torch dynamic quantized (fbgemm)", dyn))
    except Exception as exc:  # noqa: BLE001  (an optional candidate)
        print(f"(fbgemm dynamic quantized linear unavailable: {exc})")
    out["int8"].append(("ours", [PackedLinear.from_float(w, None, "int8", ops) for w in ws]))
    for fmt in out:
        for vname, vops in (variants or {}).items():
            out[fmt].append((f"ours ({vname})", [PackedLinear.from_float(w, None, fmt, vops) for w in ws]))
    return out


def step_time(layers, xs: dict[int, torch.Tensor], k_of: list[int]) -> float:
    t0 = time.perf_counter()
    with torch.inference_mode():
        for fn, k in zip(layers, k_of, strict=True):
            fn(xs[k])
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,16,48")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--size", choices=tuple(SIZES), default="default")
    ap.add_argument("--isa", choices=("avx512", "avx2", "scalar"), default=None, help="cap our kernels' ISA")
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=FLAGS",
                    help="also time our kernels compiled with these extra flags (repeatable)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    ops = native_ops()
    variants = variant_builds(args.variant)
    for o in (ops, *variants.values()):
        if args.isa:
            o.limit_isa(args.isa)
    llc = llc_bytes()
    bw = ops.read_bandwidth(max(4 * llc, 256 * 1024**2), args.threads)
    print(f"read bandwidth: {bw / 1e9:.1f} GB/s ({args.threads} threads, array {max(4 * llc, 256 * 1024**2) >> 20} MiB, "
          f"LLC {llc >> 20} MiB); our ISA: f32 {ops.isa(0)}, bf16 {ops.isa(1)}, int8 {ops.isa(2)}")
    g = torch.Generator().manual_seed(0)
    shp = shapes(args.size)
    ws = [torch.randn(m, k, generator=g) / k**0.5 for m, k in shp]
    k_of = [k for _, k in shp]
    n_weights = sum(m * k for m, k in shp)
    cands = candidates(ws, ops, variants)
    result = {"bandwidth_gbs": round(bw / 1e9, 2), "threads": args.threads, "weights": n_weights, "rows": {}}
    print(f"{'format':9} {'rows':>4} {'candidate':34} {'ms/step':>8} {'GB/s':>6} {'of bw':>6} {'GFLOP/s':>8}")
    for rows in map(int, args.rows.split(",")):
        xs = {k: torch.randn(rows, k, generator=g) for k in set(k_of)}
        for fmt, cs in cands.items():
            nbytes = n_weights * {"float32": 4, "bfloat16": 2, "int8": 1}[fmt]
            times: dict[str, list[float]] = {name: [] for name, _ in cs}
            for _name, layers in cs:  # warm up (oneDNN primitives, page faults)
                step_time(layers, xs, k_of)
            for _ in range(args.repeats):
                for name, layers in cs:
                    times[name].append(step_time(layers, xs, k_of))
            for name, ts in times.items():
                t = statistics.median(ts)
                gbs = nbytes / t / 1e9
                print(f"{fmt:9} {rows:>4} {name:34} {t * 1e3:8.2f} {gbs:6.1f} {gbs * 1e9 / bw:6.0%} "
                      f"{2 * n_weights * rows / t / 1e9:8.1f}")
                result["rows"].setdefault(str(rows), {}).setdefault(fmt, {})[name] = round(t * 1e3, 3)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
