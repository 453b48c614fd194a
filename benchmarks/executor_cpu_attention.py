"""``executor_cpu attention``: decode attention against GEMMs on CPU, at the shapes of the
serve_vs_hf workload.

    .venv/bin/python -m benchmarks.executor_cpu attention [--seqs 64] [--min-len 100] [--max-len 400]

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


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--min-len", type=int, default=100)
    ap.add_argument("--max-len", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1)


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
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
