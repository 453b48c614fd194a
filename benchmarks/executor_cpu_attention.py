"""``executor_cpu attention``: decode attention against GEMMs on CPU, at the shapes of the
serve_vs_hf workload.

    .venv/bin/python -m benchmarks.executor_cpu attention [--seqs 64] [--min-len 100] [--max-len 400]
    .venv/bin/python -m benchmarks.executor_cpu attention --units [CASES] [--threads 2]

One decode step of ``--seqs`` sequences on the default tiny Llama's shapes
(8 q / 4 KV heads of 64, hidden 512, MLP 1408, vocab 8192, 16-token blocks,
float32, 1 thread): the time per layer of the executor's torch attention
backend (``TorchAttentionBackend.forward``), split into its block gather and
its SDPA call, SDPA on the same K/V made contiguous (what a layout that needs
no transposed view would pay), the fused C decode kernel's backend
(``FusedCpuAttentionBackend.forward``, executor_svc/csrc; skipped with a note
when it cannot be built) and its ratio to the torch backend, and all GEMMs of
one layer. Then the cost per
token of all GEMMs of a step (8 layers + lm_head) by batch rows M, which
shows where CPU GEMMs stop getting cheaper per token.

``--units`` instead times the fused kernel's units against each other on a bfloat16 cache at
real models' shapes (``smollm2``: 9 query / 3 KV heads of 64; ``llama-8b``: 32 / 8 of 128;
CASES like ``smollm2:48x512``, sequences x context, blocks shuffled): the unit for this CPU's
best instruction set (csrc/paged_decode_x86.c) against the portable one (the instruction-set
limit at scalar), ms per call and K/V bytes per second, median of interleaved rounds, their
outputs checked bit for bit.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from executor_svc.attention import AttentionMetadata, TorchAttentionBackend
from executor_svc.cpu_kernels import load_decode_kernel
from executor_svc.cpu_ops import ISA_NAMES

BLOCK, KV_HEADS, Q_HEADS, HEAD, HIDDEN, MLP, VOCAB, LAYERS = 16, 4, 8, 64, 512, 1408, 8192, 8


def _ms(fn: Callable[[], object], reps: int = 20, rounds: int = 5) -> float:
    """Median over ``rounds`` of the mean of ``reps // rounds`` calls: robust to other jobs' bursts."""
    fn()
    per_round = max(1, reps // rounds)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(per_round):
            fn()
        times.append(1000 * (time.perf_counter() - start) / per_round)
    return statistics.median(times)


def _decode_case(n: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random caches, shuffled block tables and one query token per sequence."""
    lens = torch.randint(lo, hi + 1, (n,)).tolist()
    per_seq = -(-hi // BLOCK)
    k_cache = torch.randn(n * per_seq + 1, BLOCK, KV_HEADS, HEAD)  # [num_blocks, block, kv_heads, head]
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(1, n * per_seq + 1, dtype=torch.int32).view(n, per_seq)[torch.randperm(n)]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(n, dtype=torch.int64), query_start_loc=torch.arange(n + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32), block_tables=tables, max_query_len=1,
        max_seq_len=max(lens), query_start_loc_host=list(range(n + 1)), seq_lens_host=lens)
    return torch.randn(n, Q_HEADS, HEAD), k_cache, v_cache, meta


def attention_vs_gemm(n: int, lo: int, hi: int) -> dict[str, float]:
    query, k_cache, v_cache, meta = _decode_case(n, lo, hi)
    backend, length, scale = TorchAttentionBackend(), meta.max_seq_len, HEAD ** -0.5
    keys, values = backend._gather(k_cache, meta.block_tables, length), backend._gather(v_cache, meta.block_tables, length)
    mask = (torch.arange(length)[None, :] < meta.seq_lens[:, None])[:, None, None, :]  # [n, 1, 1, L]
    q = query[:, :, None, :]  # [n, q_heads, 1, head]
    kc, vc = keys.contiguous(), values.contiguous()
    linears = [torch.nn.Linear(HIDDEN, (Q_HEADS + 2 * KV_HEADS) * HEAD, bias=False),
               torch.nn.Linear(Q_HEADS * HEAD, HIDDEN, bias=False),
               torch.nn.Linear(HIDDEN, 2 * MLP, bias=False), torch.nn.Linear(MLP, HIDDEN, bias=False)]
    x, x_mlp = torch.randn(n, HIDDEN), torch.randn(n, MLP)

    def gemms() -> None:
        for lin in linears[:3]:
            lin(x)
        linears[3](x_mlp)

    kernel = load_decode_kernel()
    fused = {}
    if kernel is not None:
        from executor_svc.attention_cpu import FusedCpuAttentionBackend

        fb = FusedCpuAttentionBackend(kernel)
        torch.testing.assert_close(fb.forward(query, k_cache, v_cache, meta, scale),
                                   backend.forward(query, k_cache, v_cache, meta, scale), rtol=1e-5, atol=1e-5)
        fused["fused_forward_ms"] = _ms(lambda: fb.forward(query, k_cache, v_cache, meta, scale))
    result = {
        "backend_forward_ms": _ms(lambda: backend.forward(query, k_cache, v_cache, meta, scale)),
        "gather_kv_ms": _ms(lambda: (backend._gather(k_cache, meta.block_tables, length),
                                     backend._gather(v_cache, meta.block_tables, length))),
        "sdpa_ms": _ms(lambda: F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale,
                                                              enable_gqa=True)),
        "sdpa_contiguous_kv_ms": _ms(lambda: F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, scale=scale,
                                                                            enable_gqa=True)),
        "layer_gemms_ms": _ms(gemms),
        **fused,
    }
    if fused:
        result["torch_over_fused"] = result["backend_forward_ms"] / result["fused_forward_ms"]
    return result


def gemm_cost_per_token(rows: list[int]) -> dict[int, float]:
    """Microseconds per token of all GEMMs of one step (8 layers + lm_head), by batch rows."""
    shapes = [(HIDDEN, (Q_HEADS + 2 * KV_HEADS) * HEAD), (Q_HEADS * HEAD, HIDDEN), (HIDDEN, 2 * MLP), (MLP, HIDDEN)]
    linears = [torch.nn.Linear(i, o, bias=False) for i, o in shapes]
    lm_head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    out = {}
    for m in rows:
        xs = [torch.randn(m, i) for i, _ in shapes]

        def step(xs: list[torch.Tensor] = xs) -> None:
            for _ in range(LAYERS):
                for lin, x in zip(linears, xs, strict=True):
                    lin(x)
            lm_head(xs[0])

        out[m] = 1000 * _ms(step, reps=5) / m
    return out


UNIT_SHAPES = {"smollm2": (9, 3, 64), "llama-8b": (32, 8, 128)}  # query heads, KV heads, head size
UNIT_CASES = "smollm2:1x1024,smollm2:1x4096,smollm2:48x512,llama-8b:1x2048,llama-8b:32x1024"


def _unit_case(kernel, case: str, best: int, threads: int, rounds: int) -> dict:
    shape, _, size = case.partition(":")
    hq, hkv, d = UNIT_SHAPES[shape]
    n, ctx = (int(v) for v in size.split("x"))
    per_seq = -(-ctx // BLOCK)
    k_cache = torch.randn(n * per_seq + 1, BLOCK, hkv, d).bfloat16()
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(1, n * per_seq + 1, dtype=torch.int32).view(n, per_seq)[torch.randperm(n)].contiguous()
    lens, q, idx = torch.full((n,), ctx, dtype=torch.int32), torch.randn(n, hq, d), torch.arange(n)
    outs = {level: torch.empty_like(q) for level in (best, 0)}

    def call(level: int) -> None:
        kernel.lib.ps_set_isa_limit(level)
        kernel(outs[level], q, k_cache, v_cache, tables, lens, idx, idx, d ** -0.5, threads, check_indices=False)

    for level in outs:
        call(level)
    if not torch.equal(outs[best].view(torch.int32), outs[0].view(torch.int32)):
        raise AssertionError(f"{case}: the {ISA_NAMES[best]} unit's output differs from the portable one's")
    times: dict[int, list[float]] = {level: [] for level in outs}
    for _ in range(rounds):
        for level in times:
            times[level].append(_ms(lambda level=level: call(level), reps=10, rounds=1))
    kv_bytes = 2 * n * ctx * hkv * d * 2
    fast, slow = statistics.median(times[best]), statistics.median(times[0])
    return {"case": case, "isa": ISA_NAMES[best], "ms": round(fast, 4), "portable_ms": round(slow, 4),
            "gbs": round(kv_bytes / fast / 1e6, 1), "portable_gbs": round(kv_bytes / slow / 1e6, 1),
            "speedup": round(slow / fast, 2)}


def unit_speeds(cases: str, threads: int, rounds: int = 9) -> list[dict]:
    kernel = load_decode_kernel()
    if kernel is None:
        raise SystemExit("the fused kernel is unavailable (see the warning above)")
    best = kernel.lib.ps_isa_level(0)  # PS_W_F32's level: what picks the decode unit
    try:
        return [_unit_case(kernel, case, best, threads, rounds) for case in cases.split(",")]
    finally:
        kernel.lib.ps_set_isa_limit(2)


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--units", nargs="?", const=UNIT_CASES, default=None, metavar="CASES",
                    help=f"time the fused kernel's units instead (default cases: {UNIT_CASES})")
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1)


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    if args.units:
        rows = unit_speeds(args.units, args.threads)
        print(f"fused decode kernel, bfloat16 cache, {args.threads} thread(s): best unit vs portable unit")
        print("| case | unit | ms | K/V GB/s | portable ms | portable GB/s | speedup |\n|---|---|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['case']} | {r['isa']} | {r['ms']:.3f} | {r['gbs']} | {r['portable_ms']:.3f} | "
                  f"{r['portable_gbs']} | {r['speedup']:.2f}x |")
        return {"units": rows, "threads": args.threads}
    with torch.inference_mode():
        per_layer = attention_vs_gemm(args.seqs, args.min_len, args.max_len)
        per_token = gemm_cost_per_token([1, 8, 16, 32, 64, 128, 256])
    print(f"decode, {args.seqs} sequences of {args.min_len}-{args.max_len} tokens, per layer (ms):")
    for k, v in per_layer.items():
        print(f"  {k:<24}{v:8.2f}" + ("x" if k == "torch_over_fused" else ""))
    if "fused_forward_ms" not in per_layer:
        print("  (fused kernel unavailable: see the warning above)")
    print("all GEMMs of one step, per token (us): " + ", ".join(f"M={m}: {v:.0f}" for m, v in per_token.items()))
    return {"per_layer_ms": per_layer, "gemm_us_per_token": per_token}
