"""The runner's side of LoRA: adapters loaded as plans order them, and what a failed load means.

A plan's ``lora_loads`` come after its frees (``pagedserve/wire/messages.py``): the scheduler
loads a slot only when no sequence here uses it. A load that fails (a missing or corrupt file,
shapes of another base model, a rank above the limit) empties the slot and is reported once in
the next result (``StepResult.lora_failures``); every sequence that runs under that slot until it
is loaded again is dropped and reported failed, so none is ever computed by the base model in
its adapter's place.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from executor_svc.lora.adapter import LoraError
from executor_svc.lora.manager import LoraManager
from pagedserve import wire

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoraOutcome:
    """What a plan's LoRA loads came to, for its result: the failures, and the scheduled sequences
    dropped because their slot holds no adapter."""

    failures: list[wire.LoraFailure]
    failed_seq_ids: list[int]

    def report(self, result: wire.StepResult) -> wire.StepResult:
        result.lora_failures = self.failures
        if self.failed_seq_ids:
            result.failed_seq_ids = list(dict.fromkeys([*result.failed_seq_ids, *self.failed_seq_ids]))
            result.error = result.error or "executor error: a LoRA adapter could not be loaded"
        return result


class LoraSlotsOfRunner:
    def __init__(self, manager: LoraManager) -> None:
        self.manager = manager
        self.failed: dict[int, str] = {}  # slot -> why its last load failed
        self._owed: list[wire.LoraFailure] = []  # failures the next result reports

    @property
    def num_slots(self) -> int:
        return self.manager.max_loras

    def load(self, load: wire.LoraLoad, users: list[int]) -> None:
        """Carry out ``load``; ``users``: live sequences under that slot (the scheduler never sends
        one; refused as a broken plan)."""
        if users:
            raise ValueError(f"LoRA load of {load.name!r} into slot {load.slot}, which sequences {users[:8]} use")
        try:
            hit = self.manager.load(load.slot, load.path, key=load.name)
        except Exception as exc:  # noqa: BLE001  (LoraError, or anything else: this adapter fails, not the plan)
            if not isinstance(exc, LoraError):
                log.exception("loading LoRA adapter %r failed unexpectedly", load.name)
            self.mark_failed(load.slot, str(exc))
            log.error("LoRA adapter %r could not be loaded into slot %d: %s", load.name, load.slot, exc)
            return
        self.failed.pop(load.slot, None)
        log.info("LoRA adapter %r loaded into slot %d from %s", load.name, load.slot,
                 "host memory" if hit else load.path)

    def mark_failed(self, slot: int, reason: str) -> None:
        """Slot ``slot`` holds no adapter, for ``reason``: its sequences are dropped until it loads again
        (also a load that succeeded here but failed on another tensor-parallel rank)."""
        self.manager.unload(slot)
        self.failed[slot] = reason
        self._owed.append(wire.LoraFailure(slot, reason[:wire.MAX_TEXT_CHARS]))

    def doomed(self, seqs: dict) -> set[int]:
        """The sequences of ``seqs`` under a slot whose last load failed."""
        return {sid for sid, s in seqs.items() if s.lora_slot in self.failed} if self.failed else set()

    def take_failures(self) -> list[wire.LoraFailure]:
        out, self._owed = self._owed, []
        return out

    def batch(self, token_slots: torch.Tensor | None):
        """Around a forward: each token through its slot's adapter (``token_slots`` None: none)."""
        return self.manager.batch(token_slots if token_slots is not None else torch.empty(0, dtype=torch.int64))

    def reset(self) -> None:
        """The scheduler forgot every sequence here: it loads each adapter again when next used, from
        its files (a scheduler started again numbers its loads at run time from 1 again: a kept
        ``name#id`` might now mean other files)."""
        for slot in range(self.num_slots):
            self.manager.unload(slot)
        self.manager.cache.clear()
        self.failed.clear()
        self._owed.clear()
