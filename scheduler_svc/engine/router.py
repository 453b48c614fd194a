"""Where a new request goes: prefix-cache affinity balanced against load.

The router keeps its own approximate index of which executor holds which
prompt blocks: the chained block hashes of every prompt it routed (the same
sha256 chain the KV cache manager uses), mapped to the executor it sent them
to, LRU-bounded. It does not probe the executors' pools, so it also sees a
prefix that is still being prefilled by an earlier request (the moment a hot
prefix arrives in a burst is exactly when affinity matters most).

Cost, for each ready executor ``e`` (documented in docs/ARCHITECTURE.md):

    load(e)  = running + waiting + not-yet-admitted requests on e
    hit(e)   = prompt tokens in the longest run of leading full blocks routed to e
    holds(e) = 1 if the request names a LoRA adapter that e has in a slot, else 0
    eligible = { e : load(e) within the skew bound of the least loaded }   (pagedserve/placement.py)
    choose     argmax over eligible of (holds(e), hit(e), -load(e), free_blocks(e) - queued_blocks(e))

(An adapter's prompt blocks hash under a root of their own, so hit(e) is already per adapter.)

The skew guard, shared with the fronts' choice of an engine core, is what stops one hot
prefix from swamping a single executor.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from pagedserve.placement import within_skew

if TYPE_CHECKING:
    from scheduler_svc.engine.state import ExecutorSlot



class Router:
    def __init__(self, max_entries: int = 200_000) -> None:
        self.max_entries = max_entries
        self._owner: OrderedDict[bytes, str] = OrderedDict()  # block hash -> executor id (LRU)

    def _hit_blocks(self, hashes: list[bytes], executor_id: str) -> int:
        n = 0
        for h in hashes:
            if self._owner.get(h) != executor_id:
                break
            n += 1
        return n

    def choose(self, ready: list[ExecutorSlot], hashes: list[bytes], lora: str | None = None) -> ExecutorSlot | None:
        """The executor for a request among ``ready`` ones (each able to hold it); None if empty.
        ``hashes``: the prompt's full-block hash chain (``kv_cache_manager.hash_blocks``); ``lora``:
        the adapter it names."""
        if not ready:
            return None
        loads = {s.id: _load(s) for s in ready}
        eligible = [ready[i] for i in within_skew([loads[s.id] for s in ready])]
        hits = {s.id: self._hit_blocks(hashes, s.id) for s in eligible}
        # Load before free blocks: a request queued in a scheduler holds no blocks
        # yet, so free blocks alone would pile a burst onto whoever admitted first.
        best = max(eligible, key=lambda s: (bool(lora) and s.scheduler.lora.holds(lora), hits[s.id], -loads[s.id],
                                            _headroom(s)))
        self._remember(hashes, best.id)
        return best

    def _remember(self, hashes: list[bytes], executor_id: str) -> None:
        owner = self._owner
        for h in hashes:
            owner[h] = executor_id
            owner.move_to_end(h)
        while len(owner) > self.max_entries:
            owner.popitem(last=False)

    def forget(self, executor_id: str) -> None:
        """An executor left: its cache is gone, stop steering requests by it."""
        for h in [h for h, e in self._owner.items() if e == executor_id]:
            del self._owner[h]


def _load(s: ExecutorSlot) -> int:
    return s.scheduler.num_running + s.scheduler.num_waiting + s.scheduler.num_swapped + len(s.adds)


def _headroom(s: ExecutorSlot) -> int:
    return s.scheduler.num_free_blocks - s.queued_blocks
