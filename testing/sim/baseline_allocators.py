"""The paper's baselines: Orca with contiguous, reserve-at-admission KV allocation.

Orca (as the vLLM paper models it, §6.1) stores each request's KV cache in one
contiguous chunk reserved when the request is admitted, sized by a policy:

* ``max``:    the model's maximum sequence length (2048 slots for OPT),
* ``pow2``:   the prompt plus the output over-reserved to the next power of two
              ("if the true output length is 25, it reserves 32 positions for
              outputs", §6.1), i.e. at most 2x for the output,
* ``oracle``: exactly the final length (the system "knows" the output length).

The paper's Orca "uses the buddy allocation algorithm to determine the memory
address to store KV cache" (§6.1; §6.5 relies on it: a 1024-token prompt gets a
2048-slot chunk whatever the predicted output). :class:`BuddySpace` is that
allocator: a request's reservation is rounded up to a power of two and placed
in an aligned block of that size; freed blocks merge only with their buddy.
:class:`FirstFitSpace` (exact sizes, first fit, free neighbours coalesce) is a
kinder allocator kept for comparison. Both work in units of the scheduler's
16-slot blocks, so a reservation is also rounded up to a whole block.

:class:`ContiguousKVCacheManager` presents either space through the same
surface as the paged ``KVCacheManager`` so the *same* scheduler runs every
allocator.
"""

from __future__ import annotations

import bisect
import enum

from scheduler_svc.sched.kv_cache_manager import NO_CHANGE, NO_HIT, KVCacheManagerBase, PrefixHit, SlotChange
from scheduler_svc.sched.request import Sequence


class ReservationPolicy(enum.Enum):
    MAX = "max"
    POW2 = "pow2"
    ORACLE = "oracle"


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return 1 << (n - 1).bit_length()


def reservation_slots(policy: ReservationPolicy, prompt_len: int, output_len: int, max_model_len: int) -> int:
    """Token slots a policy reserves for a request of ``prompt_len`` + ``output_len`` tokens."""
    final_len = prompt_len + output_len
    if prompt_len < 1 or output_len < 1 or final_len > max_model_len:
        raise ValueError(f"need prompt_len, output_len >= 1 and prompt + output <= max_model_len={max_model_len}, "
                         f"got {prompt_len} + {output_len}")
    if policy is ReservationPolicy.MAX:
        return max_model_len
    if policy is ReservationPolicy.POW2:
        return min(prompt_len + next_pow2(output_len), max_model_len)
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

    @staticmethod
    def rounded(n: int) -> int:
        """Units a request for ``n`` actually takes (exactly ``n`` here)."""
        return n

    def largest_hole(self) -> int:
        return max(self._lens, default=0)

    def holes(self) -> list[tuple[int, int]]:
        """(start, length) of every free range, in address order."""
        return list(zip(self._starts, self._lens, strict=True))

    def check_integrity(self) -> None:
        """Holes and live ranges tile [0, size) exactly, holes never adjacent."""
        spans = sorted([(s, n, "hole") for s, n in zip(self._starts, self._lens, strict=True)]
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


class BuddySpace:
    """Binary buddy allocator over ``size`` units: blocks of 2^k units at multiples of 2^k.

    ``allocate(n)`` takes the lowest free block of the smallest order that
    holds ``n`` (splitting larger blocks in halves); ``free`` merges a block
    with its buddy (``start ^ 2^k``) while that one is free and whole. The
    arena need not be a power of two: it starts as the largest aligned blocks
    that fit, none above ``max_units``.
    """

    def __init__(self, size: int, max_units: int) -> None:
        if size < 1 or max_units < 1:
            raise ValueError(f"size and max_units must be >= 1, got {size}, {max_units}")
        self.size = size
        self.max_order = next_pow2(max_units).bit_length() - 1
        self._free: list[set[int]] = [set() for _ in range(self.max_order + 1)]  # order -> free starts
        self._live: dict[int, int] = {}  # start -> order of allocated blocks
        self.num_free = size
        pos = 0
        while pos < size:
            k = self.max_order
            while pos % (1 << k) or pos + (1 << k) > size:
                k -= 1
            self._free[k].add(pos)
            pos += 1 << k

    @staticmethod
    def rounded(n: int) -> int:
        """Units a request for ``n`` actually takes."""
        return next_pow2(n)

    def allocate(self, n: int) -> int | None:
        """Start of a new block of ``rounded(n)`` units, or None (nothing changes) if none is free."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        k = next_pow2(n).bit_length() - 1
        if k > self.max_order:
            return None
        j = next((j for j in range(k, self.max_order + 1) if self._free[j]), None)
        if j is None:
            return None
        start = min(self._free[j])
        self._free[j].remove(start)
        while j > k:  # split: keep the low half, free the high one
            j -= 1
            self._free[j].add(start + (1 << j))
        self._live[start] = k
        self.num_free -= 1 << k
        return start

    def free(self, start: int) -> None:
        """Release the block at ``start``, merging it with free buddies."""
        k = self._live.pop(start, None)
        if k is None:
            raise RuntimeError(f"free of block at {start}, which is not allocated (double free?)")
        self.num_free += 1 << k
        while k < self.max_order and (start ^ (1 << k)) in self._free[k]:
            self._free[k].remove(start ^ (1 << k))
            start &= ~(1 << k)
            k += 1
        self._free[k].add(start)

    def largest_hole(self) -> int:
        return max((1 << k for k, starts in enumerate(self._free) if starts), default=0)

    def holes(self) -> list[tuple[int, int]]:
        """(start, length) of every free block, in address order."""
        return sorted((s, 1 << k) for k, starts in enumerate(self._free) for s in starts)

    def check_integrity(self) -> None:
        """Free and live blocks are aligned, tile [0, size) exactly, and no free buddies are left unmerged."""
        spans = sorted([(s, k, "hole") for k, starts in enumerate(self._free) for s in starts]
                       + [(s, k, "live") for s, k in self._live.items()])
        pos = 0
        for s, k, kind in spans:
            if s != pos or s % (1 << k):
                raise RuntimeError(f"blocks do not tile the space at {pos}: next is {kind} ({s}, order {k})")
            pos = s + (1 << k)
        if pos != self.size:
            raise RuntimeError(f"blocks cover {pos} of {self.size} units")
        for k, starts in enumerate(self._free[: self.max_order]):
            if any((s ^ (1 << k)) in starts for s in starts):
                raise RuntimeError(f"free buddies of order {k} were not merged")
        if self.num_free != sum(n for _, n in self.holes()):
            raise RuntimeError(f"num_free {self.num_free} != sum of free blocks")


# ---------------------------------------------------------------------------
# the contiguous allocator behind the scheduler's KV-manager surface


class ContiguousKVCacheManager(KVCacheManagerBase):
    """Orca-style KV allocation: one contiguous chunk per request, reserved at admission.

    The chunk (``reservation_slots`` rounded up to whole blocks, then to what
    the space hands out: a power of two for ``space="buddy"``, the paper's
    allocator, or exactly that for ``"first-fit"``) is taken when the
    scheduler first asks for room for a sequence; later
    tokens of that sequence always fit inside it, so running requests never
    need more memory and are never preempted. The block ids handed to the
    scheduler are the chunk's blocks, in order, so a plan looks exactly like a
    paged one whose block tables happen to be consecutive.

    ``num_free_blocks`` is the largest hole: that is what one allocation can
    take now. No sharing (n > 1, beam search), no prefix caching, no swapping:
    the baselines in the paper have none of them.
    """

    def __init__(self, policy: ReservationPolicy | str, block_size: int, num_device_blocks: int,
                 max_model_len: int, space: str = "buddy") -> None:
        self.policy = ReservationPolicy(policy)
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_cpu_blocks = 0
        self.max_model_len = max_model_len
        if space == "buddy":
            self.space: BuddySpace | FirstFitSpace = BuddySpace(num_device_blocks, -(-max_model_len // block_size))
        elif space == "first-fit":
            self.space = FirstFitSpace(num_device_blocks)
        else:
            raise ValueError(f"space must be 'buddy' or 'first-fit', got {space!r}")
        self._chunks: dict[int, tuple[int, int]] = {}  # seq_id -> (first block, number of blocks)
        self._handed: dict[int, int] = {}  # seq_id -> blocks of the chunk given to the table so far

    # ------------------------------------------------------------------ sizing
    def final_len(self, seq: Sequence) -> int:
        """Tokens the request ends with (prompt + max_tokens, capped by the model)."""
        return min(seq.num_prompt_tokens + seq.request.req.params.max_tokens, self.max_model_len)

    def reserved_slots(self, seq: Sequence) -> int:
        """Slots the policy asks for (before the allocator rounds them up)."""
        prompt = seq.num_prompt_tokens
        return reservation_slots(self.policy, prompt, self.final_len(seq) - prompt, self.max_model_len)

    def chunk_blocks(self, seq: Sequence) -> int:
        """Blocks the request's chunk takes: the reservation rounded up by the allocator."""
        return self.space.rounded(-(-self.reserved_slots(seq) // self.block_size))

    def chunk(self, seq: Sequence) -> tuple[int, int] | None:
        """(first block, number of blocks) of the sequence's reservation, if it holds one."""
        return self._chunks.get(seq.seq_id)

    # ------------------------------------------------------------------ KVCacheManagerBase
    @property
    def num_free_blocks(self) -> int:
        return self.space.largest_hole()

    def lookup_prefix(self, seq: Sequence, known=()) -> PrefixHit:
        return NO_HIT

    def blocks_needed(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> int:
        return 0 if seq.seq_id in self._chunks else self.chunk_blocks(seq)

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> SlotChange | None:
        if hit.blocks:
            raise RuntimeError("contiguous baseline got a prefix hit, but it never reports one")
        sid = seq.seq_id
        if sid not in self._chunks:
            n = self.chunk_blocks(seq)
            start = self.space.allocate(n)
            if start is None:
                return None  # no hole large enough: the request keeps waiting (FCFS)
            self._chunks[sid] = (start, n)
            self._handed[sid] = 0
        start, n = self._chunks[sid]
        need = -(-(seq.num_computed_tokens + num_new_tokens) // self.block_size)
        have = self._handed[sid]
        if need > n:
            raise RuntimeError(f"seq {sid} needs {need} blocks but reserved {n}: reservation too small")
        if need <= have:
            return NO_CHANGE
        self._handed[sid] = need
        return SlotChange(have, list(range(start + have, start + need)))

    def commit_computed(self, seq: Sequence, num_computed: int | None = None) -> None:
        return None

    def fork(self, parent: Sequence, child: Sequence) -> None:
        raise RuntimeError("contiguous baselines cannot share KV: use n == 1 and beam_width == 1")

    def free(self, seq: Sequence) -> None:
        chunk = self._chunks.pop(seq.seq_id, None)
        if chunk is not None:
            self.space.free(chunk[0])
            del self._handed[seq.seq_id]

    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]] | None:
        return None  # no CPU pool: a preempted request is recomputed

    def swap_in(self, seqs: list[Sequence], reserve: int = 0) -> list[tuple[int, int]] | None:
        return None

    def block_ids(self, seq: Sequence) -> list[int]:
        chunk = self._chunks.get(seq.seq_id)
        if chunk is None:
            return []
        return list(range(chunk[0], chunk[0] + self._handed[seq.seq_id]))

    def stats(self) -> dict[str, int]:
        return {"used": self.num_device_blocks - self.space.num_free, "cached": 0, "shared": 0,
                "cpu_used": 0, "largest_hole": self.space.largest_hole()}

    def check_integrity(self) -> None:
        self.space.check_integrity()
        if sum(n for _, n in self._chunks.values()) != self.num_device_blocks - self.space.num_free:
            raise RuntimeError("reserved chunks do not add up to the space's used blocks")
        for sid, (_, n) in self._chunks.items():
            if not 0 <= self._handed[sid] <= n:
                raise RuntimeError(f"seq {sid} was handed {self._handed[sid]} of its {n} blocks")
