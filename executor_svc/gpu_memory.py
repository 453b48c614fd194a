"""Sizing the device KV pool from ``--gpu-memory-utilization`` (as vLLM does).

After the weights are loaded, one profiling forward at the largest step the executor will run
measures the activation peak. The KV pool then gets what is left of the utilisation share:

    kv_bytes = utilization * total - peak_torch_allocated - non_torch_bytes

``peak_torch_allocated`` covers the weights plus the profiling step's activations and logits;
``non_torch_bytes`` is what the process holds outside torch's allocator (CUDA context, cuBLAS
workspaces, CuPy's pools and loaded kernel modules), measured as ``(total - free) - reserved``.
The executor calls :func:`profile_kv_budget` with :func:`make_profile_step` on CUDA; on CPU the
``--kv-cache-memory`` flag is the budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class GpuMemoryProfile:
    total_bytes: int
    weights_bytes: int  # torch-allocated before the profiling step
    peak_bytes: int  # torch-allocated peak during the profiling step (weights included)
    non_torch_bytes: int
    kv_budget_bytes: int


def kv_budget(total: int, peak: int, non_torch: int, utilization: float) -> int:
    """Bytes left for KV blocks; 0 when the model alone exceeds the share (caller reports it)."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization: must lie in (0, 1], got {utilization}")
    return max(0, int(utilization * total) - peak - non_torch)


def profile_kv_budget(profile_step: Callable[[], None], utilization: float,
                      device: torch.device | int | None = None) -> GpuMemoryProfile:
    """Run ``profile_step`` once (a forward at the largest step size) and size the KV pool."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization: must lie in (0, 1], got {utilization}")
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    weights = torch.cuda.memory_allocated(device)
    profile_step()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    free, total = torch.cuda.mem_get_info(device)
    non_torch = max(0, (total - free) - torch.cuda.memory_reserved(device))
    torch.cuda.empty_cache()
    return GpuMemoryProfile(total, weights, peak, non_torch, kv_budget(total, peak, non_torch, utilization))


def make_profile_step(model, backend, num_tokens: int, block_size: int,
                      num_logits_rows: int = 256) -> Callable[[], None]:
    """A worst-case step: one sequence of ``num_tokens`` new tokens (the scheduler's token budget)
    through every layer with a throwaway KV pool just big enough, then logits for up to
    ``num_logits_rows`` rows (the most sequences sampled in one step)."""
    from executor_svc.attention import AttentionMetadata

    cfg, dev, dtype = model.cfg, model.device, model.dtype

    def step() -> None:
        blocks = math.ceil(num_tokens / block_size)
        shape = (blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        caches = [(torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev))
                  for _ in range(cfg.num_layers)]
        meta = AttentionMetadata(
            slot_mapping=torch.arange(num_tokens, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=dev),
            block_tables=torch.arange(blocks, dtype=torch.int32, device=dev)[None],
            max_query_len=num_tokens, max_seq_len=num_tokens,
            query_start_loc_host=[0, num_tokens], seq_lens_host=[num_tokens])
        ids = torch.randint(0, cfg.vocab_size, (num_tokens,), device=dev)
        positions = torch.arange(num_tokens, dtype=torch.int64, device=dev)
        with torch.inference_mode():
            hidden = model(ids, positions, caches, meta, backend)
            if model.with_lm_head:  # (a tensor-parallel rank other than 0 has none: rank 0 samples)
                model.compute_logits(hidden[-min(num_tokens, num_logits_rows):])
        del caches

    return step
