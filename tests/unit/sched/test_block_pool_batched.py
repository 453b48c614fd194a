"""BlockPool.touch_many / free_many and KVCacheManager.fork_many: the batched forms of touch, free
and fork leave exactly the state the one-at-a-time forms leave (refcounts, the free list's order,
the counters, the prefix-cache map), so forking and freeing a long prompt's choices in one pass
changes no eviction order and no invariant."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.wire import SamplingParams
from scheduler_svc.sched.block_pool import BlockPool
from scheduler_svc.sched.kv_cache_manager import KVCacheManager
from scheduler_svc.sched.request import Request, Sequence


def _state(pool: BlockPool) -> tuple:
    return ([(b.block_id, b.ref_cnt, b.block_hash) for b in pool.blocks], pool.free_list_ids(),
            pool.num_free_blocks, pool.num_cached_blocks, pool.num_shared_blocks, sorted(pool._by_hash))


# An op: ("alloc",), ("cache", i), ("touch", [i...], k) or ("free", [i...]); i picks a held block.
_ops = st.lists(st.one_of(
    st.tuples(st.just("alloc")),
    st.tuples(st.just("cache"), st.integers(0, 1_000)),
    st.tuples(st.just("touch"), st.lists(st.integers(0, 1_000), max_size=6), st.integers(0, 3)),
    st.tuples(st.just("free"), st.lists(st.integers(0, 1_000), max_size=6)),
), max_size=60)


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_batched_touch_and_free_leave_the_state_one_at_a_time_leaves(ops):
    one, many = BlockPool(8), BlockPool(8)
    held: list[int] = []  # one entry per reference held (block ids; both pools number alike)
    for n, op in enumerate(ops):
        if op[0] == "alloc":
            if one.num_free_blocks:
                a, b = one.allocate(), many.allocate()
                assert a.block_id == b.block_id
                held.append(a.block_id)
        elif not held:
            continue
        elif op[0] == "cache":
            bid = held[op[1] % len(held)]
            assert one.cache(one.blocks[bid], b"h%d" % n) == many.cache(many.blocks[bid], b"h%d" % n)
        elif op[0] == "touch":
            ids = [held[i % len(held)] for i in op[1]]  # (repeats included: a block touched twice)
            for bid in ids:
                for _ in range(op[2]):
                    one.touch(one.blocks[bid])
            many.touch_many([many.blocks[bid] for bid in ids], op[2])
            held += ids * op[2]
        else:
            ids = []
            for i in op[1]:  # distinct references: each is dropped once
                if held:
                    ids.append(held.pop(i % len(held)))
            for bid in ids:
                one.free(one.blocks[bid])
            many.free_many(many.blocks[bid] for bid in ids)
        assert _state(many) == _state(one)
        many.check_integrity([[many.blocks[bid] for bid in held]])


def test_free_many_refuses_a_double_free_and_keeps_the_counters_of_what_it_freed():
    pool = BlockPool(4)
    a, b = pool.allocate(), pool.allocate()
    pool.touch(b)
    with pytest.raises(RuntimeError, match=f"double free of block {a.block_id}"):
        pool.free_many([b, a, a])
    assert a.ref_cnt == 0 and b.ref_cnt == 1
    pool.check_integrity([[b]])
    assert pool.num_free_blocks == 3 and pool.num_shared_blocks == 0


def test_touch_many_with_no_children_changes_nothing_and_refuses_a_negative_count():
    pool = BlockPool(4)
    a = pool.allocate()
    pool.free(a)
    before = _state(pool)
    pool.touch_many([a], 0)
    assert _state(pool) == before
    with pytest.raises(ValueError, match="k must be >= 0, got -1"):
        pool.touch_many([a], -1)
    assert _state(pool) == before


def _seqs(prompt_len: int, n: int) -> list[Sequence]:
    req = GenerationRequest("r", list(range(10, 10 + prompt_len)), RequestParams(max_tokens=4, n=n))
    r = Request(req, 0)
    return [Sequence(i, i, list(req.prompt_token_ids), prompt_len, SamplingParams(), r) for i in range(n)]


def _kv_state(kv: KVCacheManager) -> tuple:
    return (_state(kv.pool), {s: [b.block_id for b in t] for s, t in kv._tables.items()}, kv._hashes,
            kv._registered)


@pytest.mark.parametrize("prompt_len", [1, 16, 37, 200])
def test_fork_many_is_fork_for_each_child(prompt_len):
    kvs = []
    for batched in (False, True):
        kv = KVCacheManager(16, 64, 0)
        parent, *children = _seqs(prompt_len, 4)
        other = _seqs(prompt_len, 1)[0]  # the same prompt again: its blocks are cached, freed ones revive
        other.seq_id = 99
        assert kv.allocate(other, prompt_len) is not None
        other.num_computed_tokens = prompt_len
        kv.commit_computed(other)
        kv.free(other)
        hit = kv.lookup_prefix(parent)
        assert kv.allocate(parent, prompt_len - 1 - hit.num_tokens, hit) is not None
        parent.num_computed_tokens = prompt_len - 1
        kv.commit_computed(parent)
        for c in children:
            c.num_computed_tokens = parent.num_computed_tokens
        if batched:
            kv.fork_many(parent, children)
        else:
            for c in children:
                kv.fork(parent, c)
        kv.check_integrity()
        kvs.append(kv)
    assert _kv_state(kvs[1]) == _kv_state(kvs[0])
    kv = kvs[1]
    for s in (parent, *children):
        kv.free(s)
    kv.check_integrity()
    assert kv.pool.num_used_blocks == 0 and kv.pool.num_shared_blocks == 0


def test_fork_many_refuses_children_that_are_not_distinct_new_seqs_and_changes_nothing():
    kv = KVCacheManager(16, 64, 0)
    parent, a, b = _seqs(40, 3)
    assert kv.allocate(parent, 39) is not None
    assert kv.allocate(b, 16) is not None
    before = _kv_state(kv)
    for children, why in (([a, a], "must be distinct"), ([a, parent], "not the parent"),
                          ([a, b], f"fork into seq {b.seq_id} that already holds blocks")):
        with pytest.raises(RuntimeError, match=why):
            kv.fork_many(parent, children)
        assert _kv_state(kv) == before
    kv.check_integrity()

