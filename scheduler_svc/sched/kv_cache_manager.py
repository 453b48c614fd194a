"""Per-sequence block tables over a :class:`BlockPool`: the paged KV cache.

:class:`KVCacheManagerBase` is the whole surface the scheduler uses. The paged
manager below implements it; the contiguous-reservation baselines (Orca
Max/Pow2/Oracle) implement the same methods and plug into the same Scheduler.

Invariants the scheduler relies on:

* ``allocate`` is check-then-commit: it either makes room for all requested
  tokens (and reports what changed, for the plan) or returns ``None`` and
  changes nothing.
* ``free`` is the one release point (finish, abort, preemption, errors); it is
  idempotent and releases device and CPU blocks alike.
* A partly filled block is only ever shared by sequences of one request
  (forks); prefix caching shares full blocks only, which are never written.
  So a copy-on-write source stays held by a sibling scheduled in the same
  step, and the executor can copy it after the step's swaps.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from pagedserve.kv_blocks import chain_root, hash_blocks
from scheduler_svc.sched.block_pool import Block, BlockPool
from scheduler_svc.sched.request import Sequence


@dataclass(slots=True)
class SlotChange:
    """What ``allocate`` changed in one block table, for the plan.

    ``block_ids`` replace ``table[start:]`` (a CoW replacement of the block at
    ``start`` and/or appended blocks); ``copy`` is the (src, dst) block copy a
    CoW needs. Empty ``block_ids`` and no copy: nothing to tell the executor.
    """

    start: int = 0
    block_ids: list[int] = field(default_factory=list)
    copy: tuple[int, int] | None = None


NO_CHANGE = SlotChange()  # shared, never mutated: the common decode case allocates nothing


@dataclass(slots=True)
class PrefixHit:
    """Cached full blocks a waiting sequence can reuse (no state changed yet)."""

    blocks: list[Block] = field(default_factory=list)
    num_tokens: int = 0


NO_HIT = PrefixHit()


class KVCacheManagerBase(abc.ABC):
    """What the scheduler needs from a KV allocator (paged or contiguous)."""

    block_size: int
    num_device_blocks: int
    num_cpu_blocks: int

    @property
    @abc.abstractmethod
    def num_free_blocks(self) -> int:
        """Device blocks an allocation can take now."""

    @abc.abstractmethod
    def lookup_prefix(self, seq: Sequence, known: Seq[bytes] = ()) -> PrefixHit:
        """Longest cached prefix usable by a sequence with no blocks (never all its tokens).

        ``known``: the chained hashes of the prompt's full blocks, when the caller has them
        (``hash_blocks`` without salt: a salted manager hashes for itself; so does one given
        a chain of the wrong length, i.e. for another block size). They serve the lookup only:
        the blocks the sequence computes are registered under hashes of their own tokens."""

    @abc.abstractmethod
    def blocks_needed(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> int:
        """Free device blocks ``allocate`` would take (an upper bound)."""

    @abc.abstractmethod
    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> SlotChange | None:
        """Room for tokens [computed, computed + n) (after ``hit``), or None and no change."""

    @abc.abstractmethod
    def commit_computed(self, seq: Sequence, num_computed: int | None = None) -> None:
        """The first ``num_computed`` tokens (default ``seq.num_computed_tokens``) have K/V now:
        register the blocks they fill in the prefix cache. With plans in flight the count a step
        reached is passed explicitly: the sequence's own count already includes later plans."""

    @abc.abstractmethod
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Child shares every block of parent."""

    def fork_many(self, parent: Sequence, children: Seq[Sequence]) -> None:
        """Each child shares every block of parent (:meth:`fork` for each, in order)."""
        for child in children:
            self.fork(parent, child)

    @abc.abstractmethod
    def free(self, seq: Sequence) -> None:
        """Release every block the sequence holds (device or CPU). Idempotent."""

    @abc.abstractmethod
    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]] | None:
        """Move the sequences' blocks to the CPU pool: (device, cpu) pairs, or None if no room."""

    @abc.abstractmethod
    def swap_in(self, seqs: list[Sequence], reserve: int = 0) -> list[tuple[int, int]] | None:
        """Move them back: (cpu, device) pairs, or None unless ``reserve`` blocks stay free after."""

    @abc.abstractmethod
    def block_ids(self, seq: Sequence) -> list[int]:
        """The sequence's device block table."""

    @abc.abstractmethod
    def check_integrity(self) -> None:
        """RuntimeError unless pools, refcounts and tables agree."""

    def stats(self) -> dict[str, int]:
        return {}


class KVCacheManager(KVCacheManagerBase):
    """Paged KV cache with refcounted sharing, CoW, prefix caching and swapping."""

    def __init__(self, block_size: int, num_device_blocks: int, num_cpu_blocks: int,
                 enable_prefix_caching: bool = True, hash_extra: bytes = b"") -> None:
        if num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be >= 0, got {num_cpu_blocks}")
        self.block_size = block_size
        self.num_device_blocks = num_device_blocks
        self.num_cpu_blocks = num_cpu_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._extra = hash_extra
        self.pool = BlockPool(num_device_blocks, enable_caching=enable_prefix_caching)
        self.cpu_pool = BlockPool(num_cpu_blocks, enable_caching=False) if num_cpu_blocks else None
        self._tables: dict[int, list[Block]] = {}  # seq_id -> device blocks, logical order
        self._cpu_tables: dict[int, list[Block]] = {}  # seq_id -> CPU blocks of a swapped seq
        self._hashes: dict[int, list[bytes]] = {}  # seq_id -> chained hashes of its full blocks
        self._registered: dict[int, int] = {}  # seq_id -> leading blocks already offered to the cache

    # ------------------------------------------------------------------ counters
    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def stats(self) -> dict[str, int]:
        return {
            "used": self.pool.num_used_blocks,
            "cached": self.pool.num_cached_blocks,
            "shared": self.pool.num_shared_blocks,
            "cpu_used": self.cpu_pool.num_used_blocks if self.cpu_pool else 0,
        }

    def block_ids(self, seq: Sequence) -> list[int]:
        return [b.block_id for b in self._tables.get(seq.seq_id, ())]

    def num_blocks(self, seq: Sequence) -> int:
        return len(self._tables.get(seq.seq_id, ()))

    # ------------------------------------------------------------------ prefix cache
    def _hashes_upto(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """The chained hashes of the seq's first ``num_blocks`` full blocks (memoised)."""
        hashes = self._hashes.setdefault(seq.seq_id, [])
        have, bs = len(hashes), self.block_size
        if have < num_blocks:
            req = seq.request.req
            root = hashes[-1] if hashes else chain_root(req.lora, req.lora_id, req.cache_salt)
            hashes += hash_blocks(root, seq.token_ids[have * bs:num_blocks * bs], bs, self._extra)
        return hashes

    def lookup_prefix(self, seq: Sequence, known: Seq[bytes] = ()) -> PrefixHit:
        if not self.enable_prefix_caching or seq.seq_id in self._tables:
            return NO_HIT
        # The last token is always computed: its logits are what we sample from.
        max_blocks = (seq.num_tokens - 1) // self.block_size
        claimed = (known and not self._extra and not self._hashes.get(seq.seq_id)
                   and len(known) == seq.num_prompt_tokens // self.block_size)  # (another block size: not ours)
        blocks: list[Block] = []
        for h in (known if claimed else self._hashes_upto(seq, max_blocks))[:max_blocks]:
            b = self.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        if claimed:
            # A front's hashes only find blocks. Past the hit the chain is hashed here, from the
            # tokens, as blocks are registered: a block enters the cache under the hash of what it
            # holds, whatever a front claimed. (A hit's hash is the cache's own: whatever a lying
            # front's tokens say, the blocks after it attend to the hit's K/V, so their chain is
            # the hit's.) The cost: hashing the blocks this request computes, not those it finds.
            self._hashes[seq.seq_id] = list(known[:len(blocks)])
        if not blocks:
            return NO_HIT
        return PrefixHit(blocks, len(blocks) * self.block_size)

    def commit_computed(self, seq: Sequence, num_computed: int | None = None) -> None:
        if not self.enable_prefix_caching:
            return
        table = self._tables.get(seq.seq_id)
        if table is None:
            return
        computed = seq.num_computed_tokens if num_computed is None else num_computed
        num_full = min(computed // self.block_size, len(table))
        done = self._registered.get(seq.seq_id, 0)
        if num_full <= done:
            return
        hashes = self._hashes_upto(seq, num_full)
        for i in range(done, num_full):
            self.pool.cache(table[i], hashes[i])
        self._registered[seq.seq_id] = num_full

    # ------------------------------------------------------------------ allocation
    def blocks_needed(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> int:
        table = self._tables.get(seq.seq_id, ())
        bs = self.block_size
        computed = hit.num_tokens if hit.blocks else seq.num_computed_tokens
        have = len(table) + len(hit.blocks)
        new = max(0, -(-(computed + num_new_tokens) // bs) - have)
        cow = (num_new_tokens > 0 and computed % bs != 0 and computed // bs < len(table)
               and table[computed // bs].ref_cnt > 1)
        revived = sum(1 for b in hit.blocks if b.ref_cnt == 0)  # hits that leave the free list
        return new + cow + revived

    def allocate(self, seq: Sequence, num_new_tokens: int, hit: PrefixHit = NO_HIT) -> SlotChange | None:
        sid, bs = seq.seq_id, self.block_size
        table = self._tables.get(sid)
        computed = seq.num_computed_tokens
        if table is not None and not hit.blocks:
            # Hot path (decode): room already there and the written block is private.
            end = computed + num_new_tokens
            if end <= len(table) * bs and (computed % bs == 0 or num_new_tokens == 0
                                           or table[computed // bs].ref_cnt == 1):
                return NO_CHANGE
        if hit.blocks:
            if table:
                raise RuntimeError(f"prefix hit for seq {sid} that already holds blocks")
            computed = hit.num_tokens
        if self.blocks_needed(seq, num_new_tokens, hit) > self.pool.num_free_blocks:
            return None
        if table is None:
            table = self._tables[sid] = []
        return self._commit(table, computed, num_new_tokens, hit)

    def _commit(self, table: list[Block], computed: int, n: int, hit: PrefixHit) -> SlotChange:
        pool, bs = self.pool, self.block_size
        for b in hit.blocks:
            pool.touch(b)
            table.append(b)
        start = len(table)
        copy = None
        idx = computed // bs
        if n and computed % bs and idx < len(table) and table[idx].ref_cnt > 1:
            old, new = table[idx], pool.allocate()
            table[idx] = new
            pool.free(old)  # a sibling still holds it (refcount was > 1)
            copy = (old.block_id, new.block_id)
            start = idx
        for _ in range(-(-(computed + n) // bs) - len(table)):
            table.append(pool.allocate())
        if hit.blocks:
            start = 0  # the executor learns the whole table (NewSeq) anyway
        return SlotChange(start, [b.block_id for b in table[start:]], copy)

    def rollback(self, seq: Sequence, num_tokens: int) -> int:
        """Speculation rejected positions: keep the blocks holding the first ``num_tokens`` tokens,
        free the rest (returns how many). Blocks already offered to the prefix cache hold verified
        tokens only (commit_computed runs after verification), so cutting into them is a bug."""
        table = self._tables.get(seq.seq_id)
        if table is None:
            return 0
        keep = -(-num_tokens // self.block_size)
        if keep < self._registered.get(seq.seq_id, 0):
            raise RuntimeError(f"rollback of seq {seq.seq_id} to {num_tokens} tokens cuts into its cached blocks")
        cut = table[keep:]
        del table[keep:]
        self.pool.free_many(reversed(cut))
        hashes = self._hashes.get(seq.seq_id)
        if hashes is not None:  # hashes of blocks past the kept tokens covered rejected proposals
            del hashes[num_tokens // self.block_size:]
        return len(cut)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        self.fork_many(parent, (child,))

    def fork_many(self, parent: Sequence, children: Seq[Sequence]) -> None:
        """One pass over the parent's blocks adds every child's reference (n = 16 on a 131K-token
        prompt: 15 references to each of 8K blocks)."""
        if parent.seq_id in self._cpu_tables:
            raise RuntimeError(f"fork from seq {parent.seq_id} whose blocks are swapped out")
        ids = {c.seq_id for c in children}
        if len(ids) != len(children) or parent.seq_id in ids:
            raise RuntimeError(f"fork of seq {parent.seq_id} into seqs {[c.seq_id for c in children]}: "
                               f"children must be distinct and not the parent")
        for child in children:
            if child.seq_id in self._tables or child.seq_id in self._cpu_tables:
                raise RuntimeError(f"fork into seq {child.seq_id} that already holds blocks")
        src = self._tables.get(parent.seq_id, [])  # may be empty: a 1-token prompt forks at once
        self.pool.touch_many(src, len(children))
        parent_hashes = self._hashes.get(parent.seq_id, [])
        parent_registered = self._registered.get(parent.seq_id, 0)
        for child in children:
            self._tables[child.seq_id] = list(src)
            # Only the computed prefix is known to be common; the child may diverge after it.
            shared = child.num_computed_tokens // self.block_size
            self._hashes[child.seq_id] = parent_hashes[:shared]
            self._registered[child.seq_id] = min(parent_registered, shared)

    def free(self, seq: Sequence) -> None:
        sid = seq.seq_id
        table = self._tables.pop(sid, None)
        if table is not None:
            self.pool.free_many(reversed(table))  # tail first onto the LRU end: evicted before the head
        cpu_table = self._cpu_tables.pop(sid, None)
        if cpu_table is not None:
            self.cpu_pool.free_many(reversed(cpu_table))  # type: ignore[union-attr]
        self._hashes.pop(sid, None)
        self._registered.pop(sid, None)

    # ------------------------------------------------------------------ swapping
    def swap_out(self, seqs: list[Sequence]) -> list[tuple[int, int]] | None:
        tables = [self._tables[s.seq_id] for s in seqs]
        pairs = _move(tables, self.cpu_pool, self._cpu_tables, seqs)
        if pairs is None:
            return None
        for s, table in zip(seqs, tables, strict=True):
            del self._tables[s.seq_id]
            self.pool.free_many(reversed(table))
            self._registered[s.seq_id] = 0
        return pairs

    def swap_in(self, seqs: list[Sequence], reserve: int = 0) -> list[tuple[int, int]] | None:
        tables = [self._cpu_tables[s.seq_id] for s in seqs]
        distinct = {b.block_id for t in tables for b in t}
        if len(distinct) + reserve > self.pool.num_free_blocks:
            return None
        pairs = _move(tables, self.pool, self._tables, seqs)
        if pairs is None:
            raise RuntimeError("swap_in: device pool shrank between check and commit")
        for s, table in zip(seqs, tables, strict=True):
            del self._cpu_tables[s.seq_id]
            self.cpu_pool.free_many(reversed(table))  # type: ignore[union-attr]
        return pairs

    def is_swapped(self, seq: Sequence) -> bool:
        return seq.seq_id in self._cpu_tables

    # ------------------------------------------------------------------ integrity
    def check_integrity(self) -> None:
        both = self._tables.keys() & self._cpu_tables.keys()
        if both:
            raise RuntimeError(f"seqs {sorted(both)} hold device and CPU blocks at once")
        self.pool.check_integrity(self._tables.values())
        if self.cpu_pool is not None:
            self.cpu_pool.check_integrity(self._cpu_tables.values())
        elif self._cpu_tables:
            raise RuntimeError("CPU tables exist without a CPU pool")
        for sid, table in self._tables.items():
            hashes = self._hashes.get(sid, ())
            for i in range(min(self._registered.get(sid, 0), len(table))):
                h = table[i].block_hash
                if h is not None and (i >= len(hashes) or h != hashes[i]):
                    raise RuntimeError(f"seq {sid} block {i} is cached under another content hash")


def _move(tables: list[list[Block]], dst_pool: BlockPool | None, dst_tables: dict[int, list[Block]],
          seqs: list[Sequence]) -> list[tuple[int, int]] | None:
    """Copy-plan the distinct blocks of ``tables`` into ``dst_pool`` (check, then commit).

    Blocks shared inside the group map to one destination block whose refcount
    equals the number of table entries, so sharing survives the round trip.
    """
    distinct: dict[int, Block] = {}
    for t in tables:
        for b in t:
            distinct.setdefault(b.block_id, b)
    if dst_pool is None or len(distinct) > dst_pool.num_free_blocks:
        return None
    mapping: dict[int, Block] = {}
    pairs: list[tuple[int, int]] = []
    for bid in distinct:
        nb = dst_pool.allocate()
        mapping[bid] = nb
        pairs.append((bid, nb.block_id))
    seen: set[int] = set()
    for s, t in zip(seqs, tables, strict=True):
        for b in t:
            if b.block_id in seen:  # allocate() gave the first reference
                dst_pool.touch(mapping[b.block_id])
            seen.add(b.block_id)
        dst_tables[s.seq_id] = [mapping[b.block_id] for b in t]
    return pairs
