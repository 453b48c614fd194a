"""Adapters kept in host memory (``--max-cpu-loras``, vLLM's flag): parsed and checked once.

A slot that loads an adapter it held not long ago (the scheduler gave the slot to another and
wants this one back) copies it from here instead of reading and checking its files again. At most
``capacity`` adapters are kept; the least recently used goes first.

An entry's key is what the plan's ``LoraLoad`` names: the adapter's name with the id of its load
(``pagedserve.kv_blocks.lora_key``: ``name#id`` for a load at run time) and its path. A name
loaded again at run time gets another id, so its new files are read, never the old entry's
weights (which age out). An adapter named at start (no id) is read once: replacing its files
under a running executor is not a reload (load it at run time under its name instead).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from executor_svc.lora.adapter import LoraAdapter, LoraError


class AdapterCache:
    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise LoraError(f"max_cpu_loras must be a non-negative integer, got {capacity!r}")
        self.capacity = capacity
        self._entries: OrderedDict[tuple[str, str], LoraAdapter] = OrderedDict()  # oldest use first
        self.hits = self.misses = 0

    def get(self, key: str, path: str, read: Callable[[], LoraAdapter]) -> tuple[LoraAdapter, bool]:
        """The adapter ``key`` at ``path``, and whether it came from memory; else ``read()`` (which
        raises LoraError for a bad adapter: nothing is kept then). The caller keeps it with
        :meth:`put` once it has been accepted, so a refused adapter never takes a place."""
        entry = self._entries.get((key, path))
        if entry is not None:
            self._entries.move_to_end((key, path))
            self.hits += 1
            return entry, True
        self.misses += 1
        return read(), False

    def put(self, key: str, path: str, adapter: LoraAdapter) -> None:
        """Keep ``adapter`` as the most recently used; the least recently used beyond ``capacity`` go."""
        if self.capacity == 0:
            return
        self._entries[key, path] = adapter
        self._entries.move_to_end((key, path))
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def keys(self) -> list[tuple[str, str]]:
        """(key, path) of every adapter kept, least recently used first (for logs and tests)."""
        return list(self._entries)

    def clear(self) -> None:
        self._entries.clear()
