"""Decode-attention timing on a GPU: our paged kernel vs the device's copy bandwidth and vs torch
``scaled_dot_product_attention`` over the same K/V laid out contiguously.

Times are CUDA-event medians after warm-up; each sample replays a CUDA graph of ``CALLS`` launches
(so Python launch overhead stays out) and falls back to a plain loop if capture fails. Problems
smaller than ``ROTATE_BYTES`` rotate over several disjoint block sets so L2 does not serve them.

Every decode row also times each decode variant (``launchers.DECODE_VARIANTS``: kernel and split
rule) on the same problem, after checking its output against the default's, and names the fastest:
the measurement that decides whether "auto" should change.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

import torch
import torch.nn.functional as F

from testing.kernels.decode_rows import DecodeRow, fastest, markdown, time_variants
from testing.kernels.gpu_report import PrefillRow

CALLS = 10
SAMPLES = 15
ROTATE_BYTES = 512 << 20  # several times the H200's 60 MB L2


def time_us(fn: Callable[[], object]) -> float:
    """Median microseconds per call of ``fn`` (CUDA events, graph replay when possible)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run: Callable[[], object]
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(CALLS):
                fn()
        run = graph.replay
    except Exception:  # capture unsupported for this callable: time a launch loop instead
        torch.cuda.synchronize()

        def run() -> None:
            for _ in range(CALLS):
                fn()
    run()
    samples = []
    for _ in range(SAMPLES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(samples)


def time_direct_us(fn: Callable[[], object]) -> float:
    """Median microseconds per call of ``fn`` launched directly (no graph: a copy captured in a
    graph becomes a memcpy node, which runs slower than the copy kernel)."""
    for _ in range(3):
        fn()
    samples = []
    for _ in range(SAMPLES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(samples)


def copy_bandwidth_gbs(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy launched directly, counting bytes read plus bytes written (GB/s)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    us = time_direct_us(lambda: dst.copy_(src))
    return 2 * nbytes / (us * 1e-6) / 1e9


def read_bandwidth_gbs(nbytes: int = 4 << 30) -> float:
    """Read-only bandwidth (GB/s): a sum over ``nbytes``, launched directly. This is the bar a
    decode kernel, which reads K/V and writes almost nothing, is measured against."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    us = time_direct_us(lambda: src.sum(dtype=torch.float32))
    return nbytes / (us * 1e-6) / 1e9


def prefill_row(batch: int, tokens: int, num_q_heads: int = 32, num_kv_heads: int = 8, head: int = 128,
                block_size: int = 16, dtype: torch.dtype = torch.bfloat16) -> PrefillRow:
    """Fresh prompts of ``tokens`` each (nothing cached): our paged prefill kernel against SDPA's
    causal attention (FlashAttention on an H100/H200) over the same K/V laid out contiguously."""
    from cupy_kernels.launchers import paged_attention_prefill

    blocks_per_seq = math.ceil(tokens / block_size)
    shape = (batch * blocks_per_seq, block_size, num_kv_heads, head)
    k_cache = torch.empty(shape, dtype=dtype, device="cuda").normal_()
    v_cache = torch.empty(shape, dtype=dtype, device="cuda").normal_()
    tables = torch.randperm(batch * blocks_per_seq, device="cuda").to(torch.int32).view(batch, blocks_per_seq)
    seq_lens = torch.full((batch,), tokens, dtype=torch.int32, device="cuda")
    starts = torch.arange(0, (batch + 1) * tokens, tokens, dtype=torch.int32, device="cuda")
    query = torch.randn(batch * tokens, num_q_heads, head, device="cuda").to(dtype)
    out = torch.empty_like(query)
    scale = head ** -0.5

    errors: dict[str, str] = {}

    def ours_ms(kernel: str) -> float | None:
        """One kernel's time; a kernel that raises (one never run on this GPU yet) leaves the others."""
        try:
            return time_us(lambda: paged_attention_prefill(query, k_cache, v_cache, tables, seq_lens, starts, tokens,
                                                           tokens, scale, out=out, kernel=kernel)) / 1e3
        except Exception as exc:  # noqa: BLE001
            errors[kernel] = f"{type(exc).__name__}: {exc}"
            return None

    auto_ms, simt_ms, pipe_ms = ours_ms("auto"), ours_ms("simt"), ours_ms("mma_pipe")
    q = query.view(batch, tokens, num_q_heads, head).transpose(1, 2)
    k = torch.randn(batch, num_kv_heads, tokens, head, device="cuda").to(dtype)
    v = torch.randn_like(k)
    sdpa_us = time_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True))
    return PrefillRow(f"{batch}x{tokens}", auto_ms, sdpa_us / 1e3, simt_ms, pipe_ms, errors)


def decode_row(batch: int, context: int, read_gbs: float, num_q_heads: int = 32, num_kv_heads: int = 8,
               head: int = 128, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
               variants: bool = True) -> DecodeRow:
    """``variants``: also time every decode variant (``variants_us``, ``best_variant``)."""
    from cupy_kernels.launchers import DECODE_VARIANTS, decode_partitions, num_sms, paged_attention_decode

    elem = torch.empty((), dtype=dtype).element_size()
    kv_bytes = 2 * batch * context * num_kv_heads * head * elem
    sets = max(1, math.ceil(ROTATE_BYTES / kv_bytes))
    blocks_per_seq = math.ceil(context / block_size)
    num_blocks = sets * batch * blocks_per_seq
    shape = (num_blocks, block_size, num_kv_heads, head)
    k_cache = torch.empty(shape, dtype=dtype, device="cuda").normal_()
    v_cache = torch.empty(shape, dtype=dtype, device="cuda").normal_()
    perm = torch.randperm(num_blocks, device="cuda").to(torch.int32).view(sets, batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    query = torch.randn(batch, num_q_heads, head, device="cuda").to(dtype)
    out = torch.empty_like(query)
    scale = head ** -0.5
    it = iter(range(1 << 62))

    def ours(variant: str = "auto", rotate: bool = True) -> None:
        tables = perm[next(it) % sets if rotate else 0]
        paged_attention_decode(query, k_cache, v_cache, tables, seq_lens, context, scale, out=out, variant=variant)

    kernel_us = time_us(ours)
    timed = time_variants(ours, out, kernel_us, time_us) if variants else ({}, [])
    # The same K/V, contiguous per sequence and head, for SDPA (one set: it is >= the L2 anyway
    # for the sizes where the comparison matters).
    k = torch.randn(batch, num_kv_heads, context, head, device="cuda").to(dtype)
    v = torch.randn_like(k)
    q = query[:, :, None, :]
    sdpa_us = time_us(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True))
    achieved = kv_bytes / (kernel_us * 1e-6) / 1e9
    sms = num_sms(torch.cuda.current_device())
    parts = decode_partitions(batch, num_kv_heads, context, sms)
    variant_parts = {v: decode_partitions(batch, num_kv_heads, context, sms, **spec.split)
                     for v, spec in DECODE_VARIANTS.items() if v in timed[0]}
    return DecodeRow(batch, context, parts, kv_bytes, kernel_us, sdpa_us, achieved, achieved / read_gbs,
                     kernel_us / sdpa_us, timed[0], variant_parts, timed[1], fastest(timed[0]))


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.kernels.bench``: the decode rows alone, every variant timed (a short GPU
    session's way to pick the decode variant without the rest of make gpu-check)."""
    import argparse
    import json
    from pathlib import Path

    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels.bench", description=main.__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--out", help="also write the rows here as JSON")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench: no CUDA device visible to torch", flush=True)
        return 2
    read_gbs = read_bandwidth_gbs()
    rows = []
    for batch in args.batches:
        for ctx in args.contexts:
            rows.append(decode_row(batch, ctx, read_gbs))
            torch.cuda.empty_cache()
            print(f"  batch {batch:3d} context {ctx:5d}: auto {rows[-1].kernel_us:.1f} us, best "
                  f"{rows[-1].best_variant} {rows[-1].best_us:.1f} us", flush=True)
    print(markdown(rows, read_gbs, torch.cuda.get_device_name()))
    if args.out:
        Path(args.out).write_text(json.dumps({"read_bandwidth_gbs": read_gbs, "decode": [r.as_dict() for r in rows]},
                                             indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
