"""LoraManager: the executor's one entry point to LoRA adapters (issue #40).

Built once on a loaded model (after CPU packing: the wrappers go around whatever modules the
model then has), it owns the slots, installs the wrappers and sets each step's adapters::

    lora = LoraManager(model, max_loras=4, max_rank=16, max_cpu_loras=8)
    lora.load(0, "/adapters/sql", key="sql")  # LoraError naming the problem; nothing half-loaded
    with lora.batch(token_slots):          # [num_tokens] int64, -1 = base model
        hidden, logits = model.forward_with_logits(...)
    lora.unload(0)

On a tensor-parallel rank (``shard``, with the whole model's ``base_cfg``) each adapter is read
whole, checked against the whole model, then cut to the rank's slice of every layer
(lora/sharding.py). On CUDA the deltas run through the batched kernels (cupy_kernels/lora.cu).
CUDA decode graphs replay a capture of the wrapper with no batch set: a step with adapter
tokens must run eagerly (the runner's choice, as for prompt logprobs).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from executor_svc.lora.adapter import LoraError, load_adapter
from executor_svc.lora.apply import LoraBatch, LoraState, install
from executor_svc.lora.cache import AdapterCache
from executor_svc.lora.sharding import shard_adapter
from executor_svc.lora.slots import LoraSlots
from executor_svc.model.architecture import ModelConfig
from executor_svc.parallel.shard import NO_SHARD, TPShard


class LoraManager:
    def __init__(self, model, max_loras: int, max_rank: int, dtype: torch.dtype = torch.float32,
                 max_cpu_loras: int = 0, *, shard: TPShard = NO_SHARD, base_cfg: ModelConfig | None = None,
                 kernels=None) -> None:
        """``dtype``: the slots' tensors (slots.py); ``max_cpu_loras``: adapters kept parsed in host
        memory (cache.py), 0 or at least ``max_loras``; ``shard``/``base_cfg``: a tensor-parallel rank
        and the whole model's config (each rank keeps its slice of every adapter); ``kernels``: the
        batched delta kernels (None: the CUDA ones on CUDA, torch products on CPU)."""
        if isinstance(max_cpu_loras, int) and 0 < max_cpu_loras < max_loras:
            raise LoraError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras}) (or 0: none kept)")
        self.model = model
        if shard.size > 1 and base_cfg is None:
            raise LoraError("a tensor-parallel rank's LoraManager needs the whole model's config (base_cfg)")
        if shard.size == 1 and getattr(model, "reduce", None) is not None:
            raise LoraError("this model is a tensor-parallel rank's: give LoraManager its shard")
        self.shard, self.base_cfg = shard, base_cfg if base_cfg is not None else model.cfg
        self.cache = AdapterCache(max_cpu_loras)
        self.slots = LoraSlots(model, max_loras, max_rank, dtype)  # (validates the arguments)
        self.state = LoraState(kernels=kernels)  # (kernels None: install picks the CUDA kernels on CUDA)
        install(model, self.slots, self.state)
        self._paths: dict[int, str] = {}

    @property
    def max_loras(self) -> int:
        return self.slots.max_loras

    @property
    def max_rank(self) -> int:
        return self.slots.max_rank

    def load(self, slot: int, path: str, key: str | None = None) -> bool:
        """Load the PEFT adapter at ``path`` into ``slot``, replacing what it held; on LoraError the
        slot keeps what it had. Not during a step (the slot tensors are written in place).
        ``key``: what tells this adapter from others (the plan's ``LoraLoad.name``): with one, the
        adapter is kept in host memory and taken from there next time; None: read, not kept.
        Returns whether it came from memory."""
        self.slots.check_slot(slot)
        self._not_in_step("load")
        path = str(path)
        read = lambda: shard_adapter(load_adapter(path, self.base_cfg, self.slots.max_rank),  # noqa: E731
                                     self.shard, self.base_cfg)
        adapter, hit = self.cache.get(key, path, read) if key is not None else (read(), False)
        self.slots.load(slot, adapter)
        if key is not None:
            self.cache.put(key, path, adapter)
        self._paths[slot] = path
        return hit

    def unload(self, slot: int) -> None:
        """Empty ``slot`` (an empty one stays empty)."""
        self.slots.check_slot(slot)
        self._not_in_step("unload")
        self.slots.unload(slot)
        self._paths.pop(slot, None)

    def loaded(self) -> dict[int, str]:
        """slot -> the path its adapter was loaded from."""
        return dict(sorted(self._paths.items()))

    @contextmanager
    def batch(self, token_slots: torch.Tensor | list[int]) -> Iterator[LoraBatch | None]:
        """Around one model forward: token ``i`` of the step goes through the adapter of slot
        ``token_slots[i]`` (-1: the base model). A slot holding no adapter is a LoraError."""
        self._not_in_step("batch")
        loaded = [a is not None for a in self.slots.adapters]
        step = LoraBatch.build(torch.as_tensor(token_slots), loaded, self.model.device,
                               with_kernels=self.state.kernels is not None)
        self.state.batch = step
        try:
            yield step
        finally:
            self.state.batch = None

    def _not_in_step(self, what: str) -> None:
        if self.state.batch is not None:
            raise LoraError(f"LoraManager.{what} inside a batch() step")
