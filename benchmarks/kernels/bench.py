"""Decode-attention timing on a GPU: our paged kernel vs the device's copy bandwidth and vs torch
``scaled_dot_product_attention`` over the same K/V laid out contiguously.

Times are CUDA-event medians after warm-up; each sample replays a CUDA graph of ``CALLS`` launches
(so Python launch overhead stays out) and falls back to a plain loop if capture fails. Problems
smaller than ``ROTATE_BYTES`` rotate over several disjoint block sets so L2 does not serve them.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

CALLS = 10
SAMPLES = 15
ROTATE_BYTES = 512 << 20  # several times the H200's 60 MB L2


@dataclass(slots=True)
class DecodeRow:
    batch: int
    context: int
    partitions: int
    kv_bytes: int
    kernel_us: float
    sdpa_us: float
    achieved_gbs: float
    frac_of_read: float  # achieved read bandwidth / measured read-only bandwidth
    vs_sdpa: float  # kernel time / SDPA time

    def as_dict(self) -> dict:
        return asdict(self)


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


@dataclass(slots=True)
class PrefillRow:
    case: str  # "<sequences>x<tokens>"
    ours_ms: float  # the launcher's default kernel (tensor cores for f16/bf16)
    sdpa_ms: float
    simt_ms: float  # the SIMT prefill kernel on the same problem (kernel="simt")

    def as_dict(self) -> dict:
        return asdict(self)


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

    def ours(kernel: str) -> float:
        return time_us(lambda: paged_attention_prefill(query, k_cache, v_cache, tables, seq_lens, starts, tokens,
                                                       tokens, scale, out=out, kernel=kernel))

    ours_us, simt_us = ours("auto"), ours("simt")
    q = query.view(batch, tokens, num_q_heads, head).transpose(1, 2)
    k = torch.randn(batch, num_kv_heads, tokens, head, device="cuda").to(dtype)
    v = torch.randn_like(k)
    sdpa_us = time_us(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True))
    return PrefillRow(f"{batch}x{tokens}", ours_us / 1e3, sdpa_us / 1e3, simt_us / 1e3)


def decode_row(batch: int, context: int, read_gbs: float, num_q_heads: int = 32, num_kv_heads: int = 8,
               head: int = 128, block_size: int = 16, dtype: torch.dtype = torch.bfloat16) -> DecodeRow:
    from cupy_kernels.launchers import decode_partitions, num_sms, paged_attention_decode

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

    def ours() -> None:
        tables = perm[next(it) % sets]
        paged_attention_decode(query, k_cache, v_cache, tables, seq_lens, context, scale, out=out)

    kernel_us = time_us(ours)
    # The same K/V, contiguous per sequence and head, for SDPA (one set: it is >= the L2 anyway
    # for the sizes where the comparison matters).
    k = torch.randn(batch, num_kv_heads, context, head, device="cuda").to(dtype)
    v = torch.randn_like(k)
    q = query[:, :, None, :]
    sdpa_us = time_us(lambda: F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True))
    achieved = kv_bytes / (kernel_us * 1e-6) / 1e9
    parts = decode_partitions(batch, num_kv_heads, context, num_sms(torch.cuda.current_device()))
    return DecodeRow(batch, context, parts, kv_bytes, kernel_us, sdpa_us, achieved, achieved / read_gbs,
                     kernel_us / sdpa_us)


def markdown(rows: list[DecodeRow], read_gbs: float, device: str) -> str:
    lines = [f"Decode attention, Llama-3-8B shapes (32 q heads, 8 KV heads, head 128, bf16, block 16) on "
             f"{device}; read-only bandwidth {read_gbs:.0f} GB/s.", "",
             "| batch | context | partitions | K/V MB | ours (us) | SDPA contiguous (us) | achieved GB/s "
             "| of read BW | ours / SDPA |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r.batch} | {r.context} | {r.partitions} | {r.kv_bytes / 1e6:.1f} | {r.kernel_us:.1f} "
                     f"| {r.sdpa_us:.1f} | {r.achieved_gbs:.0f} | {100 * r.frac_of_read:.0f}% "
                     f"| {r.vs_sdpa:.2f}x |")
    return "\n".join(lines)
