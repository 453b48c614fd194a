"""Thin launchers: check the torch arguments, pick the compiled configuration, launch.

Kernels run on torch's current CUDA stream (CuPy is pointed at it through ``ExternalStream``) and
read torch's memory in place: the launch passes each tensor's device address, so nothing is
copied or converted (the checks in :mod:`cupy_kernels.checks` stand in for the type safety a
CuPy array would give). CuPy is imported only when a kernel actually launches.

Decode split rule (:func:`decode_split`): one pass when the single-pass grid has at least
``4 * num_SMs`` thread blocks (every SM holds 4 resident blocks: enough loads in flight and even
balance) and the context is at most ``SPLIT_ALWAYS_ABOVE`` tokens. Otherwise the context is cut
into partitions (plus a reduce kernel) so the grid reaches about ``4 * num_SMs`` blocks: the
partition size is ``max_seq_len / wanted_partitions`` rounded up to a multiple of 64 tokens (one
tile round of the 4 warps) and clamped to [``MIN_PARTITION``, ``PARTITION_SIZE``]. Partitions
never exceed ``PARTITION_SIZE`` tokens, so long contexts always spread over many blocks.

Decode variants (``variant``, :data:`DECODE_VARIANTS`): a kernel configuration of paged_decode.cu
(``build.DECODE_KERNELS``: software pipelining, more tokens per lane, 8 warps) and the split rule's
parameters (blocks per SM aimed at, smallest partition). ``"auto"`` is ``"base"``: today's kernel and
rule. It stays the default until a GPU run (``make gpu-check``, or ``python -m benchmarks.kernels.bench``
alone, times every variant per shape) shows a variant faster; until then the others are measured,
never chosen. A fixed ``partition_size``
overrides the variant's split rule; every variant reduces a sequence's keys in an order set by its
own length and the split alone, so any variant keeps the batch-invariant guarantee (the backend runs
"auto").

Batch-invariant split (``partition_size``, :data:`INVARIANT_PARTITION` in the batch-invariant
backend): a fixed split size, not a number of splits fitted to the grid. A sequence's context is
cut at multiples of that size whatever else is in the launch, and one that fits in one partition
gets the single pass's bits (the reduce kernel copies a lone partition as it is), so its result
depends on its own length alone.

Prefill kernel choice (``kernel``): ``"auto"`` runs the tensor-core kernel (paged_prefill_mma.cu)
for f16/bf16 at the head sizes it takes (``build.MMA_HEAD_SIZES``) and the SIMT kernel
(paged_prefill.cu) otherwise (float32, head 256); ``"simt"`` forces the SIMT kernel (benchmarks
compare the two), ``"mma"`` insists on the tensor cores, ``"mma_pipe"`` on their cp.async-pipelined
kernel (``build.PREFILL_MMA_KERNELS``: measured by gpu-check, not chosen by "auto" until it wins there). The batch-invariant backend never runs a
prefill kernel (every row is a decode query), so the choice cannot touch its guarantee.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from cupy_kernels import checks
from cupy_kernels.build import (
    DECODE_KERNELS,
    MAX_PARTITIONS,
    MMA_HEAD_SIZES,
    PARTITION_SIZE,
    KernelKey,
    get_function,
    group_size,
    mma_prefill_supported,
    prefill_mma_tokens,
    prefill_tokens,
)

THREADS = 128  # PS_DECODE_THREADS / PS_PREFILL_THREADS / PS_MMA_THREADS (a decode variant's: its key's threads)
PREFILL_KERNELS = ("auto", "mma", "mma_pipe", "simt")
SPLIT_ALWAYS_ABOVE = 8192
MIN_PARTITION = 128
INVARIANT_PARTITION = 256  # the fixed split size of the batch-invariant backend (a multiple of the 64-token tile round)
LOG2E = 1.4426950408889634


@dataclass(frozen=True, slots=True)
class Launch:
    key: KernelKey
    grid: tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class DecodeVariant:
    """A decode kernel configuration and the split rule it runs with (see :func:`decode_split`)."""

    kernel: str = "base"  # a key of build.DECODE_KERNELS
    split: dict = field(default_factory=dict)  # keyword arguments of decode_split


DECODE_VARIANTS = {name: DecodeVariant(name) for name in DECODE_KERNELS} | {
    # Twice the blocks per SM and partitions down to 32 tokens: batch 1 x 2048 gets ~4 blocks per SM
    # (512 blocks on 132 SMs) where the base rule, held at 128-token partitions, gets one.
    "split8": DecodeVariant("base", {"blocks_per_sm": 8, "min_partition": 32}),
    "pipe_split8": DecodeVariant("pipe", {"blocks_per_sm": 8, "min_partition": 32}),
}


def decode_variant(variant: str) -> DecodeVariant:
    """``"auto"`` (today: ``"base"``) or a name of :data:`DECODE_VARIANTS`."""
    if variant == "auto":
        return DECODE_VARIANTS["base"]
    if variant not in DECODE_VARIANTS:
        raise ValueError(f"variant: 'auto' or one of {tuple(DECODE_VARIANTS)}, got {variant!r}")
    return DECODE_VARIANTS[variant]


def decode_split(num_seqs: int, blocks_per_seq: int, max_seq_len: int, num_sms: int, blocks_per_sm: int = 4,
                 min_partition: int = MIN_PARTITION) -> tuple[int, int]:
    """(partitions, partition size in tokens) for the decode kernel; (1, _) = single pass. The grid
    aims at ``blocks_per_sm * num_sms`` blocks; partitions are multiples of min(64, ``min_partition``)
    tokens and at least ``min_partition``."""
    if blocks_per_sm < 1 or min_partition < 1:
        raise ValueError(f"blocks_per_sm and min_partition: >= 1, got {blocks_per_sm}, {min_partition}")
    base = max(1, num_seqs * blocks_per_seq)
    target = blocks_per_sm * num_sms
    if (base >= target and max_seq_len <= SPLIT_ALWAYS_ABOVE) or max_seq_len <= min_partition:
        return 1, max(1, max_seq_len)
    wanted = math.ceil(target / base)
    granule = min(64, min_partition)
    size = granule * math.ceil(math.ceil(max_seq_len / wanted) / granule)
    size = min(PARTITION_SIZE, max(min_partition, size))
    parts = math.ceil(max_seq_len / size)
    return (1, max_seq_len) if parts == 1 else (parts, size)


def decode_partitions(num_seqs: int, blocks_per_seq: int, max_seq_len: int, num_sms: int, **split) -> int:
    return decode_split(num_seqs, blocks_per_seq, max_seq_len, num_sms, **split)[0]


def fixed_split(max_seq_len: int, partition_size: int) -> tuple[int, int]:
    """(partitions, partition size) when every context is cut every ``partition_size`` tokens."""
    if partition_size < 1 or partition_size % 64:
        raise ValueError(f"partition_size: a positive multiple of 64 tokens, got {partition_size}")
    return max(1, math.ceil(max_seq_len / partition_size)), partition_size


def plan_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                num_sms: int, partition_size: int | None = None, variant: str = "auto") -> tuple[Launch, int, int]:
    """Validate decode arguments; return the main launch, the partitions and their size (a fixed
    ``partition_size``, or the split rule of ``variant``)."""
    var = decode_variant(variant)
    _, block_size, num_kv_heads, head_size = checks.check_cache_pair(k_cache, v_cache)
    num_seqs = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    checks.check_index("seq_lens", seq_lens, torch.int32, (None,))
    checks.check_rows("query", query, query.shape[1] if query.dim() == 3 else -1, head_size,
                      k_cache.dtype, num_rows=num_seqs)
    q_per_kv = checks.check_heads(query.shape[1], num_kv_heads)
    checks.check_index("block_tables", block_tables, torch.int32, (num_seqs, None))
    _check_len(max_seq_len, block_tables.shape[1], block_size)
    g = group_size(q_per_kv)
    blocks_per_seq = num_kv_heads * (q_per_kv // g)
    parts, psize = (decode_split(num_seqs, blocks_per_seq, max_seq_len, num_sms, **var.split)
                    if partition_size is None else fixed_split(max_seq_len, partition_size))
    if parts > MAX_PARTITIONS:
        raise ValueError(f"max_seq_len: at most {MAX_PARTITIONS * psize} tokens, got {max_seq_len}")
    key = KernelKey("decode", checks.DTYPES[k_cache.dtype], head_size, block_size, g, variant=var.kernel)
    return Launch(key, (blocks_per_seq, num_seqs, parts)), parts, psize


def plan_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 max_query_len: int, max_seq_len: int, kernel: str = "auto") -> Launch:
    """Validate prefill arguments; the launch of the tensor-core or the SIMT kernel (``kernel``)."""
    if kernel not in PREFILL_KERNELS:
        raise ValueError(f"kernel: one of {PREFILL_KERNELS}, got {kernel!r}")
    _, block_size, num_kv_heads, head_size = checks.check_cache_pair(k_cache, v_cache)
    checks.check_index("seq_lens", seq_lens, torch.int32, (None,))
    num_seqs = seq_lens.shape[0]
    checks.check_index("query_start_loc", query_start_loc, torch.int32, (num_seqs + 1,))
    checks.check_rows("query", query, query.shape[1] if query.dim() == 3 else -1, head_size, k_cache.dtype)
    q_per_kv = checks.check_heads(query.shape[1], num_kv_heads)
    checks.check_index("block_tables", block_tables, torch.int32, (num_seqs, None))
    _check_len(max_seq_len, block_tables.shape[1], block_size)
    if not 0 <= max_query_len <= query.shape[0]:
        raise ValueError(f"max_query_len: must lie in [0, {query.shape[0]}] (query rows), got {max_query_len}")
    g = group_size(q_per_kv)
    dtype = checks.DTYPES[k_cache.dtype]
    mma = mma_prefill_supported(dtype, head_size)
    if kernel in ("mma", "mma_pipe") and not mma:
        raise ValueError(f"kernel: the tensor-core prefill takes float16/bfloat16 and head sizes "
                         f"{MMA_HEAD_SIZES}, got {dtype} head {head_size}")
    if mma and kernel != "simt":
        qt = prefill_mma_tokens(g)
        key = KernelKey("prefill_mma", dtype, head_size, block_size, g, qt,
                        variant="pipe" if kernel == "mma_pipe" else "base")
    else:
        qt = prefill_tokens(g)
        key = KernelKey("prefill", dtype, head_size, block_size, g, qt)
    return Launch(key, (num_kv_heads * (q_per_kv // g), num_seqs, max(1, math.ceil(max_query_len / qt))))


def _check_len(max_seq_len: int, max_blocks: int, block_size: int) -> None:
    if not 0 <= max_seq_len <= max_blocks * block_size:
        raise ValueError(f"max_seq_len: must lie in [0, {max_blocks * block_size}] "
                         f"(block_tables width x block_size), got {max_seq_len}")


def _require_cuda(**tensors: torch.Tensor) -> torch.device:
    device = next(iter(tensors.values())).device
    if device.type != "cuda":
        raise ValueError(f"{next(iter(tensors))}: the CUDA kernels need CUDA tensors, got {device}")
    checks.check_device(device, **tensors)
    return device


def _ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


@functools.cache
def num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@functools.cache
def has_mma(device_index: int) -> bool:
    """mma.sync m16n8k16 with bf16 operands needs compute capability 8.0 (Ampere) or newer."""
    return torch.cuda.get_device_capability(device_index) >= (8, 0)


@contextlib.contextmanager
def _on_torch_stream(device: torch.device) -> Iterator[int]:
    """CuPy's current device and stream := torch's, for the launches inside."""
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream, index):
        yield index


def paged_attention_decode(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                           scale: float, out: torch.Tensor | None = None,
                           num_partitions: int | None = None, partition_size: int | None = None,
                           variant: str = "auto") -> torch.Tensor:
    """One query token per sequence: query ``[num_seqs, num_q_heads, head_size]`` -> out (same
    shape, contiguous). ``max_seq_len`` must be >= every ``seq_lens`` entry (it sizes the split).
    ``partition_size``: a fixed split size (batch-invariant); ``num_partitions`` overrides the
    split rule (tests and benchmarks); ``variant``: the kernel and split rule (module notes)."""
    device = _require_cuda(k_cache=k_cache, v_cache=v_cache, query=query, block_tables=block_tables,
                           seq_lens=seq_lens)
    index = device.index if device.index is not None else torch.cuda.current_device()
    launch, parts, psize = plan_decode(query, k_cache, v_cache, block_tables, seq_lens, max_seq_len,
                                       num_sms(index), partition_size, variant)
    if num_partitions is not None:
        if not 1 <= num_partitions <= MAX_PARTITIONS:
            raise ValueError(f"num_partitions: must lie in [1, {MAX_PARTITIONS}], got {num_partitions}")
        parts, psize = num_partitions, max(1, math.ceil(max_seq_len / num_partitions))
    out = _out_like(query, out)
    num_seqs, num_q_heads, head = query.shape
    if num_seqs == 0:
        return out
    f32 = dict(dtype=torch.float32, device=device)
    part_out = torch.empty((num_seqs, num_q_heads, parts, head) if parts > 1 else (1,), **f32)
    part_max = torch.empty((num_seqs, num_q_heads, parts) if parts > 1 else (1,), **f32)
    part_sum = torch.empty_like(part_max)
    with _on_torch_stream(device) as dev:
        fn = get_function(launch.key, dev)
        grid = (launch.grid[0], launch.grid[1], parts)
        fn(grid, (launch.key.threads,), (
            _ptr(out), _ptr(part_out), _ptr(part_max), _ptr(part_sum), _ptr(query), _ptr(k_cache),
            _ptr(v_cache), _ptr(block_tables), _ptr(seq_lens), np.int64(query.stride(0)),
            np.int32(k_cache.shape[2]), np.int32(num_q_heads // k_cache.shape[2]),
            np.int32(block_tables.shape[1]), np.int32(psize), np.float32(scale * LOG2E)))
        if parts > 1:
            reduce_key = KernelKey("decode_reduce", launch.key.dtype, head)
            get_function(reduce_key, dev)((num_q_heads, num_seqs, 1), (THREADS,), (
                _ptr(out), _ptr(part_out), _ptr(part_max), _ptr(part_sum), _ptr(seq_lens),
                np.int32(parts), np.int32(psize)))
    return out


def paged_attention_prefill(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, seq_lens: torch.Tensor,
                            query_start_loc: torch.Tensor, max_query_len: int, max_seq_len: int,
                            scale: float, out: torch.Tensor | None = None, kernel: str = "auto") -> torch.Tensor:
    """Packed query ``[num_tokens, num_q_heads, head_size]`` (sequence i owns rows
    ``query_start_loc[i]:query_start_loc[i+1]``) -> out, causal over each sequence's cache.
    ``kernel``: "auto" (tensor cores where they apply), "simt", "mma" or "mma_pipe" (see the module notes)."""
    device = _require_cuda(k_cache=k_cache, v_cache=v_cache, query=query, block_tables=block_tables,
                           seq_lens=seq_lens, query_start_loc=query_start_loc)
    index = device.index if device.index is not None else torch.cuda.current_device()
    if kernel == "auto" and not has_mma(index):
        kernel = "simt"
    launch = plan_prefill(query, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                          max_query_len, max_seq_len, kernel)
    out = _out_like(query, out)
    if query.shape[0] == 0 or seq_lens.shape[0] == 0:
        return out
    with _on_torch_stream(device) as dev:
        get_function(launch.key, dev)(launch.grid, (THREADS,), (
            _ptr(out), _ptr(query), _ptr(k_cache), _ptr(v_cache), _ptr(block_tables), _ptr(seq_lens),
            _ptr(query_start_loc), np.int64(query.stride(0)), np.int32(k_cache.shape[2]),
            np.int32(query.shape[1] // k_cache.shape[2]), np.int32(block_tables.shape[1]),
            np.float32(scale * LOG2E)))
    return out


def _out_like(query: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if out.shape != query.shape or out.dtype != query.dtype or not out.is_contiguous():
        raise ValueError(f"out: expected a contiguous {tuple(query.shape)} {query.dtype} tensor, "
                         f"got {tuple(out.shape)} {out.dtype} strides {out.stride()}")
    if out.device != query.device:
        raise ValueError(f"out: must be on {query.device}, got {out.device}")
    return out
