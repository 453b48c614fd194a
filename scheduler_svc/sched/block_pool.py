"""A fixed pool of KV blocks: O(1) allocate/free, refcounts, prefix-cache map.

Every block with refcount 0 sits on one intrusive doubly linked free list
(the ``prev``/``next`` fields of :class:`Block` themselves, between two
sentinels), so taking a block out of the middle — a prefix-cache hit on a
freed block — is O(1); we never search a deque.

Order on the free list is the eviction order:

* blocks without content worth keeping (no hash) are pushed at the *head*
  and are reused first;
* blocks that still hold a cached full block (a hash) are appended at the
  *tail* (the most recently used end). ``allocate`` pops the head, so cached
  blocks are evicted least recently freed first. Callers free a sequence's
  blocks in reverse order so a sequence's tail blocks are evicted before its
  head (a shorter prefix stays useful longer).

A freed cached block stays findable through :meth:`lookup` until it is
evicted by ``allocate``.

Blocks are created on first use, not up front: a pool's Python objects grow with
the blocks it has actually handed out, so an executor reporting a huge pool (or
a hostile peer claiming one) costs nothing until the blocks are needed. Never
used blocks count as free and behave as if they sat, empty, between the
uncached and the cached part of the free list.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass


@dataclass(slots=True, eq=False)
class Block:
    """One physical KV block. ``prev``/``next`` link it into the free list."""

    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set while it holds a registered full block
    prev: Block | None = None
    next: Block | None = None

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, cached={self.block_hash is not None})"


class BlockPool:
    """``num_blocks`` blocks numbered 0..num_blocks-1 with refcounts."""

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if type(num_blocks) is not int or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks: list[Block] = []  # the blocks used so far, indexed by block_id (created on first use)
        self._head = Block(-1)  # sentinels: head.next is the next block to reuse
        self._tail = Block(-2)
        self._head.next = self._tail
        self._tail.prev = self._head
        self._num_free = num_blocks  # refcount 0: on the free list (cached or not) or never used
        self._num_cached_free = 0  # of those, how many still hold a hash
        self._num_shared = 0  # refcount > 1 (kept, not counted: GetStats may be called at any rate)
        self._by_hash: dict[bytes, Block] = {}  # registered full blocks, in use or free

    # ---------------------------------------------------------------- list ops
    def _append(self, b: Block) -> None:
        last = self._tail.prev
        b.prev = last
        b.next = self._tail
        last.next = b  # type: ignore[union-attr]
        self._tail.prev = b

    def _push_front(self, b: Block) -> None:
        first = self._head.next
        b.prev = self._head
        b.next = first
        first.prev = b  # type: ignore[union-attr]
        self._head.next = b

    @staticmethod
    def _unlink(b: Block) -> None:
        b.prev.next = b.next  # type: ignore[union-attr]
        b.next.prev = b.prev  # type: ignore[union-attr]
        b.prev = b.next = None

    # ---------------------------------------------------------------- counters
    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now (free, including evictable cached ones)."""
        return self._num_free

    @property
    def num_cached_blocks(self) -> int:
        """Free blocks that still hold prefix-cache content."""
        return self._num_cached_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    @property
    def num_shared_blocks(self) -> int:
        """Blocks referenced by more than one block-table entry."""
        return self._num_shared

    # ---------------------------------------------------------------- alloc/free
    def allocate(self) -> Block:
        """An empty block if there is one (freed, else never used), else the least recently freed
        cached one (evicting its content); refcount 1."""
        b = self._head.next
        if (b is self._tail or b.block_hash is not None) and len(self.blocks) < self.num_blocks:  # type: ignore[union-attr]
            b = Block(len(self.blocks), ref_cnt=1)
            self.blocks.append(b)
            self._num_free -= 1
            return b
        if b is self._tail:
            raise RuntimeError("BlockPool.allocate on an empty pool: callers must check num_free_blocks")
        self._unlink(b)  # type: ignore[arg-type]
        self._num_free -= 1
        if b.block_hash is not None:  # type: ignore[union-attr]
            self._num_cached_free -= 1
            del self._by_hash[b.block_hash]  # type: ignore[union-attr]
            b.block_hash = None  # type: ignore[union-attr]
        b.ref_cnt = 1  # type: ignore[union-attr]
        return b  # type: ignore[return-value]

    def touch(self, b: Block) -> None:
        """One more reference (a fork, or a prefix-cache hit that may revive a free block)."""
        if b.ref_cnt == 0:
            self._unlink(b)
            self._num_free -= 1
            if b.block_hash is not None:
                self._num_cached_free -= 1
        b.ref_cnt += 1
        if b.ref_cnt == 2:
            self._num_shared += 1

    def free(self, b: Block) -> None:
        """Drop one reference; at zero the block joins the free list."""
        if b.ref_cnt <= 0:
            raise RuntimeError(f"double free of block {b.block_id}")
        b.ref_cnt -= 1
        if b.ref_cnt == 1:
            self._num_shared -= 1
        elif b.ref_cnt == 0:
            self._num_free += 1
            if b.block_hash is not None:
                self._num_cached_free += 1
                self._append(b)  # keep it findable; evicted LRU first
            else:
                self._push_front(b)  # nothing worth keeping: reuse first

    def touch_many(self, blocks: Iterable[Block], k: int) -> None:
        """``k`` more references to each of ``blocks`` (a sequence forked into ``k`` children):
        :meth:`touch` ``k`` times over, in one pass (15 choices of an 8K-block prompt add 123K
        references; one pass touches each block once)."""
        if k <= 0:
            if k < 0:
                raise ValueError(f"touch_many: k must be >= 0, got {k}")
            return
        shared = free = cached = 0
        for b in blocks:
            r = b.ref_cnt
            if r == 0:
                b.prev.next = b.next  # type: ignore[union-attr]  (off the free list, as _unlink)
                b.next.prev = b.prev  # type: ignore[union-attr]
                b.prev = b.next = None
                free += 1
                if b.block_hash is not None:
                    cached += 1
            if r < 2 <= r + k:
                shared += 1
            b.ref_cnt = r + k
        self._num_free -= free
        self._num_cached_free -= cached
        self._num_shared += shared

    def free_many(self, blocks: Iterable[Block]) -> None:
        """:meth:`free` each of ``blocks`` in turn (give a table reversed: its tail is evicted
        first), in one tight pass: most blocks of a forked request only lose a reference."""
        head, tail = self._head, self._tail
        unshared = free = cached = 0
        try:
            for b in blocks:
                r = b.ref_cnt - 1
                if r > 1:
                    b.ref_cnt = r
                    continue
                if r < 0:
                    raise RuntimeError(f"double free of block {b.block_id}")
                b.ref_cnt = r
                if r:
                    unshared += 1
                    continue
                free += 1
                if b.block_hash is not None:  # keep it findable; evicted LRU first (as _append)
                    cached += 1
                    last = tail.prev
                    b.prev, b.next = last, tail
                    last.next = tail.prev = b  # type: ignore[union-attr]
                else:  # nothing worth keeping: reuse first (as _push_front)
                    first = head.next
                    b.prev, b.next = head, first
                    first.prev = head.next = b  # type: ignore[union-attr]
        finally:  # (the counters stay exact for the blocks freed before a double free)
            self._num_shared -= unshared
            self._num_free += free
            self._num_cached_free += cached

    # ---------------------------------------------------------------- prefix cache
    def lookup(self, block_hash: bytes) -> Block | None:
        return self._by_hash.get(block_hash)

    def cache(self, b: Block, block_hash: bytes) -> bool:
        """Register a full, in-use block under ``block_hash``.

        Returns False when caching is off, the block is already registered, or
        another block already holds this content (the first one stays the
        canonical copy; this one simply is not findable).
        """
        if not self.enable_caching or b.block_hash is not None or block_hash in self._by_hash:
            return False
        if b.ref_cnt <= 0:
            raise RuntimeError(f"caching free block {b.block_id}: only computed, held blocks are cached")
        b.block_hash = block_hash
        self._by_hash[block_hash] = b
        return True

    # ---------------------------------------------------------------- integrity
    def check_integrity(self, tables: Iterable[Sequence[Block]]) -> None:
        """Raise RuntimeError unless the pool agrees with the given block tables.

        ``tables`` must be *every* block table that holds references into this
        pool; each block's refcount must equal the number of entries pointing
        at it. Also checks the free list (both directions), the counters and
        the hash map.
        """
        refs = [0] * len(self.blocks)
        for table in tables:
            for b in table:
                if not 0 <= b.block_id < len(self.blocks) or self.blocks[b.block_id] is not b:
                    raise RuntimeError(f"block table holds a block not from this pool: {b!r}")
                refs[b.block_id] += 1
        for b in self.blocks:
            if b.ref_cnt != refs[b.block_id]:
                raise RuntimeError(
                    f"block {b.block_id}: refcount {b.ref_cnt} but {refs[b.block_id]} table entries")
        seen = self._walk_free_list()
        free_blocks = [b for b in self.blocks if b.ref_cnt == 0]
        never_used = self.num_blocks - len(self.blocks)
        if len(seen) != len(free_blocks) or len(seen) + never_used != self._num_free:
            raise RuntimeError(
                f"free list holds {len(seen)} blocks, {len(free_blocks)} have refcount 0, {never_used} were "
                f"never used, counter says {self._num_free}")
        shared = sum(1 for b in self.blocks if b.ref_cnt > 1)
        if shared != self._num_shared:
            raise RuntimeError(f"shared-block counter {self._num_shared} != actual {shared}")
        cached_free = sum(1 for b in free_blocks if b.block_hash is not None)
        if cached_free != self._num_cached_free:
            raise RuntimeError(f"cached-free counter {self._num_cached_free} != actual {cached_free}")
        in_use = len(self.blocks) - len(free_blocks)
        uncached_free = len(free_blocks) - cached_free + never_used
        if uncached_free + in_use + cached_free != self.num_blocks:
            raise RuntimeError("free + in use + cached != total")
        for h, b in self._by_hash.items():
            if b.block_hash != h:
                raise RuntimeError(f"hash map entry points at block {b.block_id} with another hash")
        if sum(1 for b in self.blocks if b.block_hash is not None) != len(self._by_hash):
            raise RuntimeError("a block holds a hash that is not in the hash map")

    def _walk_free_list(self) -> set[int]:
        seen: set[int] = set()
        prev, b = self._head, self._head.next
        while b is not self._tail:
            if b is None or b.prev is not prev:
                raise RuntimeError("free list links are broken")
            if b.block_id in seen:
                raise RuntimeError(f"block {b.block_id} is on the free list twice")
            if b.ref_cnt != 0:
                raise RuntimeError(f"block {b.block_id} is on the free list with refcount {b.ref_cnt}")
            seen.add(b.block_id)
            prev, b = b, b.next
        if self._tail.prev is not prev:
            raise RuntimeError("free list tail sentinel is stale")
        return seen

    def free_list_ids(self) -> list[int]:
        """Block ids on the free list, next-to-reuse first (for tests and debugging)."""
        out = []
        b = self._head.next
        while b is not self._tail:
            out.append(b.block_id)  # type: ignore[union-attr]
            b = b.next  # type: ignore[union-attr]
        return out
