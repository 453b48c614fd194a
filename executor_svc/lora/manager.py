"""LoraManager: the executor's one entry point to LoRA adapters (issue #40).

Built once on a loaded model (after CPU packing: the wrappers go around whatever modules the
model then has), it owns the slots, installs the wrappers and sets each step's adapters::

    lora = LoraManager(model, max_loras=4, max_rank=16, max_cpu_loras=8)
    lora.load(0, "/adapters/sql", key="sql")  # LoraError naming the problem; nothing half-loaded
    with lora.batch(token_slots):          # [num_tokens] int64, -1 = base model
        hidden, logits = model.forward_with_logits(...)
    lora.unload(0)

Tensor-parallel ranks are refused (LoraError) until adapters are sharded with their layers.
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
from executor_svc.lora.slots import LoraSlots


class LoraManager:
    def __init__(self, model, max_loras: int, max_rank: int, dtype: torch.dtype = torch.float32,
                 max_cpu_loras: int = 0) -> None:
        """``dtype``: the slots' tensors (slots.py); ``max_cpu_loras``: adapters kept parsed in host
        memory (cache.py), 0 or at least ``max_loras``."""
        if isinstance(max_cpu_loras, int) and 0 < max_cpu_loras < max_loras:
            raise LoraError(f"max_cpu_loras ({max_cpu_loras}) must be >= max_loras ({max_loras}) (or 0: none kept)")
        self.cache = AdapterCache(max_cpu_loras)
        self.model = model
        self.slots = LoraSlots(model, max_loras, max_rank, dtype)  # (validates the arguments and refuses TP)
        self.state = LoraState()
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
        read = lambda: load_adapter(path, self.model.cfg, self.slots.max_rank)  # noqa: E731
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
        step = LoraBatch.build(torch.as_tensor(token_slots), loaded, self.model.device)
        self.state.batch = step
        try:
            yield step
        finally:
            self.state.batch = None

    def _not_in_step(self, what: str) -> None:
        if self.state.batch is not None:
            raise LoraError(f"LoraManager.{what} inside a batch() step")
