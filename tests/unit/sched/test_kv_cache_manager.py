"""KVCacheManager: check-then-commit, prefix caching, fork/CoW, swapping, and a stateful model."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule

from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.kv_blocks import hash_block, hash_blocks
from pagedserve.wire import SamplingParams
from scheduler_svc.sched.kv_cache_manager import NO_CHANGE, NO_HIT, KVCacheManager
from scheduler_svc.sched.request import Request, Sequence

_REQ = Request(GenerationRequest("r", [1], RequestParams(max_tokens=1)), 0)


def mkseq(sid: int, tokens: list[int], computed: int = 0) -> Sequence:
    return Sequence(sid, 0, list(tokens), len(tokens), SamplingParams(), _REQ, computed)


def compute(kv: KVCacheManager, seq: Sequence, n: int):
    ch = kv.allocate(seq, n)
    if ch is not None:
        seq.num_computed_tokens += n
        kv.commit_computed(seq)
    return ch


def test_hash_block_is_a_sha256_chain():
    h1 = hash_block(None, [1, 2], b"")
    assert len(h1) == 32 and h1 == hash_block(None, [1, 2], b"")
    assert hash_block(h1, [3, 4]) != hash_block(None, [3, 4])  # depends on the whole prefix
    assert hash_block(None, [1, 2], b"salt") != h1
    assert h1 == hashlib.sha256(b"\x00" * 32 + (1).to_bytes(8, "little") + (2).to_bytes(8, "little")).digest()


@given(tokens=st.lists(st.integers(-2**63, 2**63 - 1), max_size=70), block_size=st.sampled_from([1, 4, 16]),
       extra=st.sampled_from([b"", b"salt"]), parent=st.sampled_from([None, b"\x07" * 32]))
def test_hash_blocks_is_hash_block_over_each_full_block(tokens, block_size, extra, parent):
    """The one-pass chain (routing, prefix lookups) and the per-block one (blocks filled while
    decoding) must give the same hashes, or a prompt would never hit blocks a decode cached."""
    want, h = [], parent
    for i in range(len(tokens) // block_size):
        h = hash_block(h, tokens[i * block_size:(i + 1) * block_size], extra)
        want.append(h)
    assert hash_blocks(parent, tokens, block_size, extra) == want


def test_allocate_is_check_then_commit():
    kv = KVCacheManager(4, 3, 0)
    a = mkseq(0, list(range(12)))
    assert compute(kv, a, 8) is not None and kv.num_free_blocks == 1
    b = mkseq(1, list(range(9)))
    before = (kv.num_free_blocks, kv.block_ids(a))
    assert kv.allocate(b, 9) is None  # needs 3 blocks, 1 free
    assert (kv.num_free_blocks, kv.block_ids(a)) == before and kv.block_ids(b) == []
    kv.check_integrity()


def test_decode_in_room_changes_nothing():
    kv = KVCacheManager(4, 4, 0)
    s = mkseq(0, list(range(6)))
    ch = compute(kv, s, 5)
    assert ch is not None and ch.start == 0 and len(ch.block_ids) == 2
    assert compute(kv, s, 1) is NO_CHANGE
    s.token_ids += [7, 8, 9]
    assert compute(kv, s, 2) is NO_CHANGE  # fills block 1
    ch = compute(kv, s, 1)
    assert ch.start == 2 and len(ch.block_ids) == 1 and ch.copy is None


def test_prefix_hit_reuses_full_blocks_but_always_computes_the_last_token():
    kv = KVCacheManager(4, 8, 0)
    prompt = list(range(100, 112))  # exactly 3 full blocks
    a = mkseq(0, prompt)
    compute(kv, a, 12)
    b = mkseq(1, prompt)
    hit = kv.lookup_prefix(b)
    assert hit.num_tokens == 8  # not 12: the last token's logits are needed
    assert [x.block_id for x in hit.blocks] == kv.block_ids(a)[:2]
    c = mkseq(2, prompt[:6] + [0] * 6)  # shares only the first block
    assert kv.lookup_prefix(c).num_tokens == 4
    ch = kv.allocate(b, 4, hit)
    b.num_computed_tokens = 8
    assert ch.start == 0 and ch.block_ids[:2] == kv.block_ids(a)[:2]
    assert kv.pool.blocks[kv.block_ids(a)[0]].ref_cnt == 2
    kv.check_integrity()


def test_freed_cached_blocks_stay_findable_and_tail_is_evicted_first():
    kv = KVCacheManager(2, 4, 0)
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    a = mkseq(0, prompt)
    compute(kv, a, 9)  # 4 full blocks + 1 partial = 5 > 4 blocks?
    assert kv.block_ids(a) == []  # did not fit: nothing changed
    compute(kv, a, 8)
    kv.free(a)
    kv.free(a)  # idempotent
    assert kv.pool.num_cached_blocks == 4
    filler = mkseq(1, [0, 0])
    compute(kv, filler, 2)  # evicts exactly one cached block: a's tail
    b = mkseq(2, prompt)
    assert kv.lookup_prefix(b).num_tokens == 6  # head blocks survive
    kv.check_integrity()


def test_fork_shares_blocks_and_copy_on_write_on_the_partial_block():
    kv = KVCacheManager(4, 8, 0)
    parent = mkseq(0, list(range(6)))
    compute(kv, parent, 5)  # blocks [0..3], [4 | partial]
    child = mkseq(1, list(parent.token_ids), 5)
    kv.fork(parent, child)
    assert kv.block_ids(child) == kv.block_ids(parent)
    assert all(kv.pool.blocks[b].ref_cnt == 2 for b in kv.block_ids(parent))
    old_last = kv.block_ids(parent)[1]
    ch = compute(kv, child, 1)  # writes position 5 into the shared partial block
    assert ch.copy == (old_last, ch.block_ids[0]) and ch.start == 1
    assert kv.block_ids(child)[0] == kv.block_ids(parent)[0]  # full block stays shared
    assert kv.pool.blocks[old_last].ref_cnt == 1
    assert compute(kv, parent, 1) is NO_CHANGE  # sole owner now: writes in place
    kv.check_integrity()
    kv.free(child)
    kv.free(parent)
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_fork_at_a_block_boundary_needs_no_copy():
    kv = KVCacheManager(4, 8, 0)
    parent = mkseq(0, list(range(9)))
    compute(kv, parent, 8)
    child = mkseq(1, list(parent.token_ids), 8)
    kv.fork(parent, child)
    ch = compute(kv, child, 1)
    assert ch.copy is None and ch.start == 2


def test_swap_round_trip_keeps_sharing_and_is_all_or_nothing():
    kv = KVCacheManager(4, 8, 3)
    a = mkseq(0, list(range(7)))
    compute(kv, a, 7)  # 2 blocks
    b = mkseq(1, list(a.token_ids), 7)
    kv.fork(a, b)
    compute(kv, b, 0)
    big = mkseq(2, list(range(13)))
    compute(kv, big, 13)  # 4 blocks: too many for 3 CPU blocks
    assert kv.swap_out([big]) is None and len(kv.block_ids(big)) == 4
    pairs = kv.swap_out([a, b])
    assert len(pairs) == 2  # shared blocks travel once
    assert kv.block_ids(a) == [] and kv.is_swapped(a)
    assert kv.cpu_pool.blocks[pairs[0][1]].ref_cnt == 2
    kv.check_integrity()
    assert kv.swap_in([a, b], reserve=10) is None and kv.is_swapped(a)  # would break the reserve
    back = kv.swap_in([a, b])
    assert [c for c, _ in back] == [c for _, c in pairs]
    assert kv.block_ids(a) == kv.block_ids(b) and kv.cpu_pool.num_used_blocks == 0
    kv.check_integrity()
    for s in (a, b, big):
        kv.free(s)
    assert kv.num_free_blocks == 8
    kv.check_integrity()


# --------------------------------------------------------------------------- stateful model

BS = 4
NUM_BLOCKS = 24


def _fps(tokens: list[int]) -> list[int]:
    out, h = [], 0
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class KVMachine(RuleBasedStateMachine):
    """Random allocate/append/fork/free/prefix-hit/swap/evict against a content model.

    ``dev``/``cpu`` model what each physical slot holds (a fingerprint of the
    token history up to it). After every step every sequence's computed
    positions must read back their own fingerprints through its table, and
    check_integrity() must hold: no leak, no double free, no block shared that
    should not be.
    """

    seqs = Bundle("seqs")

    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(BS, NUM_BLOCKS, 8, enable_prefix_caching=True)
        self.dev: dict[int, list] = {}
        self.cpu: dict[int, list] = {}
        self.live: dict[int, Sequence] = {}
        self.next_id = 0

    def _new(self, tokens: list[int], computed: int = 0) -> Sequence:
        s = mkseq(self.next_id, tokens, computed)
        self.next_id += 1
        self.live[s.seq_id] = s
        return s

    def _write(self, s: Sequence, n: int) -> None:
        table, fps = self.kv.block_ids(s), _fps(s.token_ids)
        for pos in range(s.num_computed_tokens, s.num_computed_tokens + n):
            self.dev.setdefault(table[pos // BS], [None] * BS)[pos % BS] = fps[pos]
        s.num_computed_tokens += n
        self.kv.commit_computed(s)

    def _apply(self, s: Sequence, ch, n: int) -> None:
        if ch.copy is not None:
            src, dst = ch.copy
            self.dev[dst] = list(self.dev.get(src, [None] * BS))
        self._write(s, n)

    @rule(target=seqs, tokens=st.lists(st.integers(0, 1), min_size=1, max_size=14))
    def new_seq(self, tokens):
        s = self._new(tokens)
        hit = self.kv.lookup_prefix(s)
        ch = self.kv.allocate(s, 0, hit)
        if ch is not None:
            s.num_computed_tokens = hit.num_tokens
        return s

    @rule(s=seqs, k=st.integers(1, 3))
    def compute(self, s, k):
        if s.seq_id not in self.live or self.kv.is_swapped(s):
            return
        k = min(k, s.num_tokens - s.num_computed_tokens)
        if k <= 0:
            return
        before = (self.kv.num_free_blocks, self.kv.block_ids(s))
        ch = self.kv.allocate(s, k)
        if ch is None:
            assert (self.kv.num_free_blocks, self.kv.block_ids(s)) == before
            return
        self._apply(s, ch, k)

    @rule(s=seqs, tok=st.integers(0, 1))
    def append(self, s, tok):
        if s.seq_id in self.live and s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(tok)

    @rule(target=seqs, s=seqs, tail=st.lists(st.integers(0, 1), max_size=3))
    def fork(self, s, tail):
        """Child shares the computed prefix, then diverges (as beams and choices do)."""
        if s.seq_id not in self.live or self.kv.is_swapped(s):
            return s
        child = self._new(s.token_ids[: s.num_computed_tokens] + tail, s.num_computed_tokens)
        self.kv.fork(s, child)
        return child

    @rule(target=seqs, s=seqs, tail=st.lists(st.integers(0, 1), min_size=1, max_size=3))
    def fork_and_diverge(self, s, tail):
        """Fork, then both write right away: the shared partial block needs a copy."""
        child = self.fork(s, tail)
        if child is not s:
            self.compute(child, 1)
            self.compute(s, 1)
        return child

    @rule(s=consumes(seqs))
    def free(self, s):
        self.kv.free(s)
        self.kv.free(s)  # idempotent
        self.live.pop(s.seq_id, None)

    @rule(s=seqs)
    def swap_out(self, s):
        if s.seq_id not in self.live or self.kv.is_swapped(s):
            return
        pairs = self.kv.swap_out([s])
        for d, c in pairs or ():
            self.cpu[c] = list(self.dev.get(d, [None] * BS))

    @rule(s=seqs)
    def swap_in(self, s):
        if s.seq_id not in self.live or not self.kv.is_swapped(s):
            return
        pairs = self.kv.swap_in([s])
        for c, d in pairs or ():
            self.dev[d] = list(self.cpu[c])

    @rule(n=st.integers(1, 6))
    def evict(self, n):
        """A filler sequence takes free blocks, evicting cached ones LRU-first."""
        s = self._new([7] * (n * BS))
        ch = self.kv.allocate(s, n * BS)
        if ch is not None:
            self._apply(s, ch, n * BS)
        self.kv.free(s)
        self.live.pop(s.seq_id)

    @precondition(lambda self: self.live)
    @invariant()
    def consistent(self):
        self.kv.check_integrity()
        for s in self.live.values():
            if self.kv.is_swapped(s):
                continue
            table, fps = self.kv.block_ids(s), _fps(s.token_ids)
            assert len(table) * BS >= s.num_computed_tokens
            for pos in range(s.num_computed_tokens):
                assert self.dev[table[pos // BS]][pos % BS] == fps[pos], (s.seq_id, pos)

    def teardown(self):
        for s in list(self.live.values()):
            self.kv.free(s)
        self.kv.check_integrity()
        assert self.kv.num_free_blocks == NUM_BLOCKS and self.kv.cpu_pool.num_used_blocks == 0


KVMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
TestKVMachine = KVMachine.TestCase


@pytest.mark.parametrize("bad", [-1])
def test_negative_cpu_blocks_rejected(bad):
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        KVCacheManager(4, 4, bad)


@pytest.mark.parametrize("prompt_len", [31, 32, 33])  # 32: the prompt ends on a block boundary
def test_known_prompt_hashes_give_the_same_hits_without_hashing_again(prompt_len, monkeypatch):
    """The engine hashes a prompt once (for routing) and hands the chain to the scheduler: the
    lookup must find exactly what it would have found, never the prompt's last token, and
    hash nothing it was given."""
    from scheduler_svc.sched import kv_cache_manager

    prompt = list(range(100, 100 + prompt_len))
    warm = KVCacheManager(4, 32, 0)
    a = mkseq(0, prompt + [7])
    assert compute(warm, a, prompt_len + 1) is not None  # every block of the prompt is cached
    hashed = []
    real = kv_cache_manager.hash_blocks
    monkeypatch.setattr(kv_cache_manager, "hash_blocks",
                        lambda parent, toks, bs, extra=b"": hashed.append(len(toks)) or real(parent, toks, bs, extra))
    plain = warm.lookup_prefix(mkseq(1, list(prompt)))
    from_known = warm.lookup_prefix(mkseq(2, list(prompt)), real(None, prompt, 4))
    assert from_known.blocks == plain.blocks and from_known.num_tokens == plain.num_tokens
    assert plain.num_tokens == (prompt_len - 1) // 4 * 4  # the last token is always computed
    assert hashed == [(prompt_len - 1) // 4 * 4]  # the plain lookup hashed its prompt; the other, nothing


def _admit_and_compute(kv: KVCacheManager, seq: Sequence, known) -> int:
    """As admission does: the prefix hit found with ``known``, then the rest computed; the hit's tokens."""
    hit = kv.lookup_prefix(seq, known)
    assert kv.allocate(seq, 0, hit) is not None
    seq.num_computed_tokens = hit.num_tokens
    assert compute(kv, seq, seq.num_tokens - hit.num_tokens) is not None
    kv.check_integrity()
    return hit.num_tokens


def test_a_front_claiming_other_tokens_hashes_cannot_poison_the_cache():
    """A front's hashes find blocks; they never name what a sequence computes. A sequence of
    tokens X sent with the chain of tokens Y registers its blocks under X's hashes: a later Y
    misses them, a later X finds them."""
    x, y = list(range(100, 113)), list(range(200, 213))  # 3 full blocks and one token
    kv = KVCacheManager(4, 32, 0)
    assert _admit_and_compute(kv, mkseq(0, x), hash_blocks(None, y, 4)) == 0
    assert kv.lookup_prefix(mkseq(1, y), hash_blocks(None, y, 4)) is NO_HIT
    assert kv.lookup_prefix(mkseq(2, y)) is NO_HIT
    assert kv.lookup_prefix(mkseq(3, x), hash_blocks(None, x, 4)).num_tokens == 12


def test_blocks_after_a_claimed_hit_are_registered_under_the_hits_chain():
    """A lying front can make its own sequence reuse another prompt's cached blocks (P's K/V for
    its tokens X). The blocks it then computes attend to P's K/V, so they are registered under
    P's chain and its own later tokens T, whatever chain it claimed (P + U): an honest P + T
    finds K/V of P + T, an honest P + U only P's block, an honest X + T nothing."""
    p, x = list(range(100, 104)), list(range(300, 304))
    t, u = list(range(500, 509)), list(range(700, 709))
    kv = KVCacheManager(4, 32, 0)
    assert _admit_and_compute(kv, mkseq(0, p + [1]), None) == 0  # P's block cached
    liar = mkseq(1, x + t)
    assert _admit_and_compute(kv, liar, hash_blocks(None, p + u, 4)) == 4  # P's block, claimed for X
    assert kv.lookup_prefix(mkseq(2, x + t)) is NO_HIT
    assert kv.lookup_prefix(mkseq(4, p + u), hash_blocks(None, p + u, 4)).num_tokens == 4
    honest = kv.lookup_prefix(mkseq(3, p + t))
    assert honest.num_tokens == 12 and honest.blocks[1:] == kv._tables[liar.seq_id][1:3]


def test_a_salted_manager_hashes_for_itself():
    """Known hashes are unsalted: a manager with a salt must not take them for its own."""
    kv = KVCacheManager(4, 32, 0, hash_extra=b"model-b")
    a = mkseq(0, list(range(9)))
    assert compute(kv, a, 9) is not None
    unsalted = hash_blocks(None, list(range(9)), 4)
    hit = kv.lookup_prefix(mkseq(1, list(range(9))), unsalted)
    assert hit.num_tokens == 8  # found by its own (salted) hashes
    assert kv.lookup_prefix(mkseq(2, list(range(9))), [b"\0" * 32, b"\1" * 32]).num_tokens == 8


def test_hashes_for_another_block_size_are_not_taken():
    """A request's prompt chain is computed for the engine's block size; a manager with another
    one (a request reused across engines in a test, say) must not look its blocks up by it."""
    kv = KVCacheManager(4, 32, 0)
    assert compute(kv, mkseq(0, list(range(17))), 17) is not None
    for_8 = hash_blocks(None, list(range(17)), 8)  # 2 hashes; this manager's chain has 4
    assert kv.lookup_prefix(mkseq(1, list(range(17))), for_8).num_tokens == 16
