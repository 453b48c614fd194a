"""Per-layer paged KV block pools on the device and the CPU swap pool.

Layout (docs/ARCHITECTURE.md): per layer a key and a value tensor, each
``[num_blocks, block_size, num_kv_heads, head_size]``, contiguous. The number
of blocks comes from a memory budget; it is reported in the handshake and the
scheduler owns which block holds what.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from executor_svc.model.architecture import ModelConfig


def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Keys and values of one block in every layer."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def num_blocks_for(budget_bytes: int, cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    return budget_bytes // bytes_per_block(cfg, block_size, dtype)


class KVCache:
    """The device block pools (``layers``) and the CPU swap pool (``cpu_layers``)."""

    def __init__(self, cfg: ModelConfig, block_size: int, num_blocks: int, num_cpu_blocks: int,
                 dtype: torch.dtype, device: str | torch.device = "cpu") -> None:
        if block_size <= 0 or num_blocks <= 0:
            raise ValueError(f"kv cache: block_size ({block_size}) and num_blocks ({num_blocks}) must be > 0; "
                             f"raise the KV cache memory budget")
        if num_cpu_blocks < 0:
            raise ValueError(f"kv cache: num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.block_size, self.num_blocks, self.num_cpu_blocks = block_size, num_blocks, num_cpu_blocks
        self.dtype, self.device = dtype, torch.device(device)
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        # Zeroed: masked-out slots are still multiplied by zero attention weights, and 0 * NaN
        # garbage would poison the output.
        self.layers = [(torch.zeros(shape, dtype=dtype, device=self.device),
                        torch.zeros(shape, dtype=dtype, device=self.device)) for _ in range(cfg.num_layers)]
        cpu_shape = (num_cpu_blocks, *shape[1:])
        # Swap blocks are only ever read after being written from the device pool: no need to zero.
        pin = self.device.type == "cuda"  # page-locked host memory: faster, asynchronous swaps
        self.cpu_layers = [(torch.empty(cpu_shape, dtype=dtype, pin_memory=pin),
                            torch.empty(cpu_shape, dtype=dtype, pin_memory=pin))
                           for _ in range(cfg.num_layers)] if num_cpu_blocks else []

    @property
    def device_bytes(self) -> int:
        """Bytes of the device block pools (every layer's keys and values)."""
        return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in self.layers)

    @classmethod
    def from_budget(cls, cfg: ModelConfig, block_size: int, device_bytes: int, cpu_bytes: int,
                    dtype: torch.dtype, device: str | torch.device = "cpu",
                    agree: Callable[[tuple[int, int]], tuple[int, int]] | None = None) -> KVCache:
        """Pools sized from byte budgets. ``agree`` turns this rank's (device, CPU) block counts into
        the tensor-parallel group's: the minimum over ranks, so one block table fits every rank."""
        own = (num_blocks_for(device_bytes, cfg, block_size, dtype), num_blocks_for(cpu_bytes, cfg, block_size, dtype))
        num, num_cpu = agree(own) if agree is not None else own
        if num <= 0:
            need = bytes_per_block(cfg, block_size, dtype)
            if own[0] > 0:
                raise ValueError(f"kv cache memory: another rank of the tensor-parallel group has room for no "
                                 f"block ({need} bytes each); raise its budget")
            raise ValueError(f"kv cache memory: {device_bytes} bytes is less than one block ({need} bytes)")
        return cls(cfg, block_size, num, num_cpu, dtype, device)
