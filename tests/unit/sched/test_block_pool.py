"""BlockPool: O(1) free list order, refcounts, prefix-cache lifetime, integrity checks."""

from __future__ import annotations

import pytest

from scheduler_svc.sched.block_pool import BlockPool


def test_allocate_free_and_counters():
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    assert {a.block_id, b.block_id} == {0, 1} and a.ref_cnt == b.ref_cnt == 1
    assert pool.num_free_blocks == 2 and pool.num_used_blocks == 2
    pool.touch(a)
    assert a.ref_cnt == 2 and pool.num_shared_blocks == 1
    pool.free(a)
    pool.free(a)
    assert pool.num_free_blocks == 3
    pool.check_integrity([[b]])
    with pytest.raises(RuntimeError, match="double free"):
        pool.free(a)


def test_empty_pool_and_bad_size():
    pool = BlockPool(1)
    pool.allocate()
    with pytest.raises(RuntimeError, match="empty pool"):
        pool.allocate()
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0)


def test_uncached_blocks_are_reused_before_cached_ones():
    pool = BlockPool(3)
    a, b, c = pool.allocate(), pool.allocate(), pool.allocate()
    assert pool.cache(a, b"A") and pool.cache(b, b"B")
    pool.free(a)
    pool.free(c)  # no content: goes to the head
    pool.free(b)
    assert pool.free_list_ids() == [c.block_id, a.block_id, b.block_id]
    assert pool.num_cached_blocks == 2
    assert pool.allocate() is c
    assert pool.lookup(b"A") is a  # still findable
    assert pool.allocate() is a  # LRU: freed first, evicted first
    assert pool.lookup(b"A") is None and a.block_hash is None
    assert pool.lookup(b"B") is b
    pool.check_integrity([[c], [a]])


def test_cache_hit_revives_a_free_block_from_the_middle():
    pool = BlockPool(3)
    blocks = [pool.allocate() for _ in range(3)]
    for i, blk in enumerate(blocks):
        pool.cache(blk, bytes([i]))
    for blk in blocks:
        pool.free(blk)
    mid = pool.lookup(bytes([1]))
    pool.touch(mid)  # O(1) unlink from the middle of the list
    assert pool.free_list_ids() == [0, 2]
    assert pool.num_free_blocks == 2 and pool.num_cached_blocks == 2
    pool.check_integrity([[mid]])


def test_cache_keeps_first_copy_and_respects_switch():
    pool = BlockPool(3)
    a, b = pool.allocate(), pool.allocate()
    assert pool.cache(a, b"h")
    assert not pool.cache(b, b"h")  # duplicate content: first stays canonical
    assert pool.lookup(b"h") is a and b.block_hash is None
    off = BlockPool(2, enable_caching=False)
    x = off.allocate()
    assert not off.cache(x, b"h") and off.lookup(b"h") is None


def test_integrity_catches_refcount_mismatch_and_broken_links():
    pool = BlockPool(3)
    a = pool.allocate()
    with pytest.raises(RuntimeError, match="refcount 1 but 0"):
        pool.check_integrity([])
    with pytest.raises(RuntimeError, match="refcount 1 but 2"):
        pool.check_integrity([[a, a]])
    pool.check_integrity([[a]])
    b = pool.allocate()
    pool.free(b)  # on the free list now
    b.ref_cnt = 1  # corrupt: held but still linked
    with pytest.raises(RuntimeError):
        pool.check_integrity([[a], [b]])
    b.ref_cnt = 0
    b.next.prev = None  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match="links|stale"):
        pool.check_integrity([[a]])


def test_blocks_are_created_on_first_use_so_a_huge_pool_costs_nothing_until_used():
    pool = BlockPool(2**40)  # what a hostile handshake once claimed: 1.37 GB of objects, eagerly
    assert pool.num_free_blocks == 2**40 and len(pool.blocks) == 0
    a, b = pool.allocate(), pool.allocate()
    assert (a.block_id, b.block_id) == (0, 1) and len(pool.blocks) == 2
    pool.cache(a, b"A")
    pool.free(a)  # cached: kept for a hit while never-used blocks remain
    pool.free(b)  # empty: reused first
    assert pool.allocate() is b
    assert pool.allocate().block_id == 2 and pool.lookup(b"A") is a
    pool.check_integrity([[b], [pool.blocks[2]]])


def test_stats_never_walk_the_pool():
    """GetStats and the metrics read the pool's counters at whatever rate clients ask: with
    100K blocks a walk would hold the event loop for milliseconds per call."""
    pool = BlockPool(64)
    a, b = pool.allocate(), pool.allocate()
    pool.touch(a)
    pool.touch(a)  # a: 3 references
    pool.touch(b)
    pool.free(b)  # b: back to 1

    class NoWalk(list):
        def __iter__(self):
            raise AssertionError("a counter walked the pool")

    blocks, pool.blocks = pool.blocks, NoWalk(pool.blocks)
    assert (pool.num_shared_blocks, pool.num_used_blocks, pool.num_cached_blocks, pool.num_free_blocks) == (1, 2, 0, 62)
    pool.blocks = blocks
    pool.check_integrity([[a, a, a], [b]])
    pool.free(a)
    pool.free(a)
    assert pool.num_shared_blocks == 0
    pool.check_integrity([[a], [b]])
