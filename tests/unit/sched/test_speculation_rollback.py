"""KV slots reserved for proposals and rolled back after verification: nothing leaks, nothing
rejected reaches the prefix cache."""

from __future__ import annotations

import random

import pytest

from pagedserve.kv_blocks import hash_blocks
from scheduler_svc.sched.kv_cache_manager import KVCacheManager
from tests.unit.sched.test_kv_cache_manager import mkseq

BS = 4


def _speculate(kv: KVCacheManager, seq, proposals: list[int], accepted: int, correction: int) -> None:
    """One verify step as the scheduler would run it: reserve slots for the last token and the
    proposals, score them, keep ``accepted`` proposals plus the target's token, roll back the rest."""
    assert seq.num_computed_tokens == seq.num_tokens - 1
    seq.token_ids += proposals
    assert kv.allocate(seq, 1 + len(proposals)) is not None
    del seq.token_ids[len(seq.token_ids) - len(proposals) + accepted:]
    seq.token_ids.append(correction)
    seq.num_computed_tokens = seq.num_tokens - 1  # the correction is sampled, not yet computed
    kv.rollback(seq, seq.num_computed_tokens)
    kv.commit_computed(seq)


def _prefill(kv: KVCacheManager, seq) -> None:
    assert kv.allocate(seq, seq.num_tokens - 1) is not None
    seq.num_computed_tokens = seq.num_tokens - 1
    kv.commit_computed(seq)


def test_rejected_positions_free_their_blocks():
    kv = KVCacheManager(BS, 16, 0)
    seq = mkseq(0, [1, 2, 3, 4, 5, 6])
    _prefill(kv, seq)  # 5 computed: 2 blocks
    assert kv.num_blocks(seq) == 2
    seq.token_ids += [7, 8, 9, 10, 11, 12, 13]  # proposals
    kv.allocate(seq, 8)  # positions 5..12: 4 blocks
    assert kv.num_blocks(seq) == 4
    del seq.token_ids[7:]  # one proposal accepted
    seq.token_ids.append(99)
    seq.num_computed_tokens = 7
    assert kv.rollback(seq, 7) == 2
    assert kv.num_blocks(seq) == 2 and kv.num_free_blocks == 14
    kv.check_integrity()


@pytest.mark.parametrize("caching", [True, False])
def test_random_speculation_never_leaks_and_caches_only_verified_tokens(caching):
    rng = random.Random(7)
    kv = KVCacheManager(BS, 64, 0, enable_prefix_caching=caching)
    seqs = [mkseq(i, [rng.randrange(50) for _ in range(rng.randint(2, 9))]) for i in range(4)]
    for s in seqs:
        _prefill(kv, s)
    for _ in range(60):
        s = rng.choice(seqs)
        k = rng.randint(1, 6)
        _speculate(kv, s, [rng.randrange(50) for _ in range(k)], rng.randint(0, k), rng.randrange(50))
        kv.check_integrity()
        assert kv.num_blocks(s) == -(-s.num_computed_tokens // BS)
        if caching:  # the memoised hashes are those of the sequence's true tokens
            full = s.num_computed_tokens // BS
            assert kv._hashes_upto(s, full)[:full] == hash_blocks(None, s.token_ids[:full * BS], BS, b"")
    for s in seqs:
        kv.free(s)
    kv.check_integrity()
    assert kv.num_free_blocks == 64


def test_rollback_into_cached_blocks_is_refused():
    kv = KVCacheManager(BS, 16, 0)
    seq = mkseq(0, list(range(10)))
    _prefill(kv, seq)  # 9 computed, 2 blocks cached
    with pytest.raises(RuntimeError, match="cached blocks"):
        kv.rollback(seq, 3)
