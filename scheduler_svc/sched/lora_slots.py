"""Which LoRA adapter each of an executor's adapter slots holds, and which the running requests pin.

An executor computes at most ``--max-loras`` adapters in one step: it has that many slots, and
the scheduler decides what each holds. A request is admitted only when its adapter has a slot:
the one already holding it, else an empty one, else the least recently used slot that no
admitted request pins (its adapter is then loaded over the old one, by the plan that admits the
request). A slot stays pinned from admission until the request leaves the executor (finished,
failed, preempted by recompute, migrated): an adapter is never replaced under a request that
uses it. Swapped-out requests keep their pin, as they keep their KV.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(slots=True)
class _Slot:
    name: str | None = None
    pins: int = 0
    last_use: int = 0


class LoraSlots:
    def __init__(self, num_slots: int) -> None:
        self._slots = [_Slot() for _ in range(num_slots)]
        self._tick = itertools.count(1)

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    def slot_of(self, name: str) -> int | None:
        for i, s in enumerate(self._slots):
            if s.name == name:
                return i
        return None

    def holds(self, name: str) -> bool:
        return self.slot_of(name) is not None

    def acquire(self, name: str) -> tuple[int, bool] | None:
        """Pin a slot for ``name``: (slot, whether the adapter must be loaded into it first), or None
        when every slot is pinned by other adapters' requests."""
        i = self.slot_of(name)
        load = i is None
        if i is None:
            free = [j for j, s in enumerate(self._slots) if s.pins == 0]
            if not free:
                return None
            i = min(free, key=lambda j: (self._slots[j].name is not None, self._slots[j].last_use))
            self._slots[i].name = name
        s = self._slots[i]
        s.pins += 1
        s.last_use = next(self._tick)
        return i, load

    def unload(self, slot: int) -> None:
        """The executor could not load the slot's adapter: it holds nothing there."""
        self._slots[slot].name = None

    def release(self, slot: int) -> None:
        s = self._slots[slot]
        if s.pins <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than pinned")
        s.pins -= 1

    def forget(self, name: str) -> bool:
        """Drop ``name`` from its slot (the adapter was unloaded); False while a request pins it."""
        i = self.slot_of(name)
        if i is None:
            return True
        if self._slots[i].pins:
            return False
        self._slots[i].name = None
        return True

    def reset(self) -> None:
        """The executor's state is gone (it restarted, or its requests moved away)."""
        for s in self._slots:
            s.name, s.pins = None, 0

    def held(self) -> dict[int, str]:
        return {i: s.name for i, s in enumerate(self._slots) if s.name is not None}

    def check(self, pins: dict[int, int]) -> None:
        """Invariant: each slot's pin count equals the admitted requests that use it (``pins``)."""
        for i, s in enumerate(self._slots):
            if s.pins != pins.get(i, 0):
                raise RuntimeError(f"LoRA slot {i} ({s.name}) has {s.pins} pins, {pins.get(i, 0)} requests use it")
            if s.pins and s.name is None:
                raise RuntimeError(f"LoRA slot {i} is pinned but holds no adapter")
        extra = set(pins) - set(range(len(self._slots)))
        if extra:
            raise RuntimeError(f"requests use LoRA slots {sorted(extra)} that do not exist")
