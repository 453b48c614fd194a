"""The paper's baselines: Orca with contiguous, reserve-at-admission KV allocation.

Orca (as the vLLM paper models it, §6.1) stores each request's KV cache in one
contiguous chunk reserved when the request is admitted, sized by a policy:

* ``max``:    the model's maximum sequence length (2048 slots for OPT),
* ``pow2``:   the next power of two of the final length (prompt + output), i.e.
              an over-reservation of at most 2x,
* ``oracle``: exactly the final length (the system "knows" the output length).

We model the contiguous memory honestly: the KV cache is one range of slots
(in units of the scheduler's 16-slot blocks, so each request also rounds its
reservation up to a block: at most 15 slots of extra waste per request), and a
request needs one *contiguous* free range at admission, found first-fit. Freed
ranges coalesce with free neighbours. Gaps too small for the next request are
external fragmentation, which the paper's Fig. 2 reports.

:class:`FirstFitSpace` is the allocator of contiguous ranges;
:class:`ContiguousKVCacheManager` presents it through the same surface as the
paged ``KVCacheManager`` so the *same* scheduler runs every allocator.
"""

from __future__ import annotations

import bisect
import enum


class ReservationPolicy(enum.Enum):
    MAX = "max"
    POW2 = "pow2"
    ORACLE = "oracle"


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return 1 << (n - 1).bit_length()


def reservation_slots(policy: ReservationPolicy, final_len: int, max_model_len: int) -> int:
    """Token slots reserved for a request whose prompt + output is ``final_len`` tokens."""
    if not 1 <= final_len <= max_model_len:
        raise ValueError(f"final_len must be in [1, max_model_len={max_model_len}], got {final_len}")
    if policy is ReservationPolicy.MAX:
        return max_model_len
    if policy is ReservationPolicy.POW2:
        return min(next_pow2(final_len), max_model_len)
    return final_len


class FirstFitSpace:
    """Contiguous ranges of ``size`` units, allocated first-fit, coalesced on free.

    The free list is two parallel sorted lists (hole starts, hole lengths); the
    number of holes stays small (bounded by the number of live ranges + 1), so
    O(holes) scans are cheap.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = size
        self._starts: list[int] = [0]  # sorted hole starts
        self._lens: list[int] = [size]  # hole lengths, parallel to _starts
        self._live: dict[int, int] = {}  # start -> length of allocated ranges
        self.num_free = size

    def allocate(self, n: int) -> int | None:
        """Start of a new range of ``n`` units, or None (nothing changes) if no hole fits."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        for i, length in enumerate(self._lens):
            if length >= n:
                start = self._starts[i]
                if length == n:
                    del self._starts[i], self._lens[i]
                else:
                    self._starts[i] += n
                    self._lens[i] -= n
                self._live[start] = n
                self.num_free -= n
                return start
        return None

    def free(self, start: int) -> None:
        """Release the range that begins at ``start``, merging it with adjacent holes."""
        n = self._live.pop(start, None)
        if n is None:
            raise RuntimeError(f"free of range at {start}, which is not allocated (double free?)")
        self.num_free += n
        i = bisect.bisect_left(self._starts, start)
        merge_prev = i > 0 and self._starts[i - 1] + self._lens[i - 1] == start
        merge_next = i < len(self._starts) and start + n == self._starts[i]
        if merge_prev and merge_next:
            self._lens[i - 1] += n + self._lens[i]
            del self._starts[i], self._lens[i]
        elif merge_prev:
            self._lens[i - 1] += n
        elif merge_next:
            self._starts[i] = start
            self._lens[i] += n
        else:
            self._starts.insert(i, start)
            self._lens.insert(i, n)

    def largest_hole(self) -> int:
        return max(self._lens, default=0)

    def holes(self) -> list[tuple[int, int]]:
        """(start, length) of every free range, in address order."""
        return list(zip(self._starts, self._lens))

    def check_integrity(self) -> None:
        """Holes and live ranges tile [0, size) exactly, holes never adjacent."""
        spans = sorted([(s, n, "hole") for s, n in zip(self._starts, self._lens)]
                       + [(s, n, "live") for s, n in self._live.items()])
        pos = 0
        prev_kind = ""
        for s, n, kind in spans:
            if s != pos or n < 1:
                raise RuntimeError(f"ranges do not tile the space at {pos}: next is {kind} ({s}, {n})")
            if kind == "hole" and prev_kind == "hole":
                raise RuntimeError(f"adjacent holes at {s} were not coalesced")
            pos, prev_kind = s + n, kind
        if pos != self.size:
            raise RuntimeError(f"ranges cover {pos} of {self.size} units")
        if self.num_free != sum(self._lens):
            raise RuntimeError(f"num_free {self.num_free} != sum of holes {sum(self._lens)}")
