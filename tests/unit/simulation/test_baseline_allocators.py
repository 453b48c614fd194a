"""Orca-style contiguous reservation: policies, first-fit ranges, fragmentation."""

from __future__ import annotations

import random

import pytest

from testing.sim.baseline_allocators import (
    BuddySpace,
    FirstFitSpace,
    ReservationPolicy,
    next_pow2,
    reservation_slots,
)


def test_reservation_policies():
    assert reservation_slots(ReservationPolicy.MAX, 40, 60, 2048) == 2048
    # Pow2 over-reserves the *output* to a power of two (paper §6.1: output 25 -> 32 positions)
    assert reservation_slots(ReservationPolicy.POW2, 40, 25, 2048) == 40 + 32
    assert reservation_slots(ReservationPolicy.POW2, 40, 64, 2048) == 40 + 64
    assert reservation_slots(ReservationPolicy.POW2, 1100, 600, 2048) == 2048  # capped by the model
    assert reservation_slots(ReservationPolicy.ORACLE, 40, 60, 2048) == 100
    assert [next_pow2(n) for n in (1, 2, 3, 5, 1024, 1025)] == [1, 2, 4, 8, 1024, 2048]


def test_reservation_rejects_lengths_beyond_the_model():
    with pytest.raises(ValueError, match="max_model_len"):
        reservation_slots(ReservationPolicy.ORACLE, 1000, 1049, 2048)
    with pytest.raises(ValueError, match="output_len"):
        reservation_slots(ReservationPolicy.ORACLE, 10, 0, 2048)


def test_buddy_rounds_to_powers_of_two_at_aligned_addresses():
    space = BuddySpace(64, max_units=32)
    assert space.holes() == [(0, 32), (32, 32)]
    a = space.allocate(5)  # takes 8 units: split 32 -> 16 + 8 + 8
    assert a == 0 and space.num_free == 56
    b = space.allocate(3)  # 4 units, from the free 8 at 8
    assert b == 8 and space.holes() == [(12, 4), (16, 16), (32, 32)]
    assert space.allocate(33) is None  # larger than the largest order
    space.free(a)
    space.free(b)  # 8 merges with 0..8, then with 16..32: one 32 again
    assert space.holes() == [(0, 32), (32, 32)]
    space.check_integrity()


def test_buddy_does_not_merge_neighbours_that_are_not_buddies():
    space = BuddySpace(16, max_units=16)
    starts = [space.allocate(4) for _ in range(4)]
    assert starts == [0, 4, 8, 12]
    space.free(4)
    space.free(8)  # 4..12 are free and adjacent, but 4's buddy is 0 and 8's is 12
    assert space.holes() == [(4, 4), (8, 4)] and space.num_free == 8
    assert space.allocate(8) is None  # external fragmentation: no free aligned 8
    space.free(12)
    assert space.allocate(8) == 8
    space.check_integrity()


def _churn(space, max_units: int, seed: int, steps: int = 3000) -> list[int]:
    """Random allocate/free, integrity checked after each; returns the starts still allocated."""
    rng = random.Random(seed)
    live: list[int] = []
    for _ in range(steps):
        if live and rng.random() < 0.5:
            space.free(live.pop(rng.randrange(len(live))))
        else:
            start = space.allocate(rng.randint(1, max_units))
            if start is not None:
                live.append(start)
        space.check_integrity()
    return live


def test_buddy_arena_need_not_be_a_power_of_two():
    space = BuddySpace(983, max_units=128)  # the paper's 983 blocks: 7 x 128 + 64 + 16 + 4 + 2 + 1
    assert [n for _, n in space.holes()] == [128] * 7 + [64, 16, 4, 2, 1]
    for s in _churn(space, max_units=128, seed=5):
        space.free(s)
    assert [n for _, n in space.holes()] == [128] * 7 + [64, 16, 4, 2, 1]


def test_first_fit_takes_the_lowest_hole_that_fits():
    space = FirstFitSpace(100)
    a, b, c = space.allocate(30), space.allocate(30), space.allocate(30)
    assert (a, b, c) == (0, 30, 60)
    space.free(a)
    assert space.allocate(40) is None  # 30 + 10 free but not contiguous: external fragmentation
    assert space.num_free == 40
    assert space.allocate(20) == 0  # first fit lands in the low hole
    space.check_integrity()


def test_free_coalesces_neighbours():
    space = FirstFitSpace(90)
    a, b, c = space.allocate(30), space.allocate(30), space.allocate(30)
    space.free(a)
    space.free(c)
    assert space.holes() == [(0, 30), (60, 30)]
    space.free(b)
    assert space.holes() == [(0, 90)]
    assert space.allocate(90) == 0
    space.check_integrity()


def test_failed_allocation_changes_nothing_and_double_free_is_a_bug():
    space = FirstFitSpace(10)
    assert space.allocate(11) is None
    assert space.holes() == [(0, 10)] and space.num_free == 10
    s = space.allocate(4)
    space.free(s)
    with pytest.raises(RuntimeError, match="not allocated"):
        space.free(s)


def test_random_churn_keeps_ranges_tiled():
    space = FirstFitSpace(500)
    _churn(space, max_units=60, seed=3)
    assert space.largest_hole() <= space.num_free


# ---------------------------------------------------------------------------
# the contiguous manager inside the real Scheduler


def _sim(allocator: str, trace, num_blocks: int, snapshots: list | None = None, space: str = "buddy"):
    from testing.sim.executor import SimExecutor, simulate
    from testing.sim.runs import make_scheduler, to_requests

    sched = make_scheduler(allocator, num_blocks=num_blocks, space=space)
    batch_sizes: list[int] = []

    def check(now, plan, seconds):
        sched.check_integrity()
        batch_sizes.append(len(plan.scheduled_seq_ids))
        if snapshots is not None:
            snapshots.append((len(sched.waiting), sched.kv.space.num_free, sched.kv.space.largest_hole()))

    run = simulate(sched, SimExecutor(seed=1), to_requests(trace), check)
    sched.check_integrity()
    return sched, run, batch_sizes


def _trace(lengths, gap=0.0):
    from pagedserve.bench.workloads import TraceRequest

    return [TraceRequest(f"r{i}", i * gap, tuple(range(10, 10 + p)), o) for i, (p, o) in enumerate(lengths)]


@pytest.mark.parametrize("space", ["buddy", "first-fit"])
@pytest.mark.parametrize("allocator", ["orca-oracle", "orca-pow2", "orca-max", "paged"])
def test_every_allocator_finishes_every_request_at_its_length(allocator, space):
    from pagedserve.bench.workloads import synthetic_trace

    trace = synthetic_trace("alpaca", 40, 50.0, seed=4)
    sched, run, _ = _sim(allocator, trace, num_blocks=300, space=space)
    assert run.output_tokens == {t.request_id: t.output_len for t in trace}
    free = sched.kv.space.num_free if allocator != "paged" else sched.num_free_blocks
    assert not sched.requests and free == 300  # everything released


def test_chunks_follow_the_policy_and_plans_use_chunk_blocks():
    from testing.sim.runs import make_scheduler, to_requests

    # prompt 50 + output 60: Oracle reserves 110 slots = 7 blocks, Pow2 50 + 64 = 114 slots = 8
    # blocks, Max 2048 = 128 blocks; the buddy allocator rounds 7 up to 8, first fit does not.
    cases = (("orca-oracle", "first-fit", 7), ("orca-oracle", "buddy", 8), ("orca-pow2", "first-fit", 8),
             ("orca-pow2", "buddy", 8), ("orca-max", "buddy", 128))
    for allocator, space, blocks in cases:
        sched = make_scheduler(allocator, num_blocks=400, space=space)
        sched.add_request(to_requests(_trace([(50, 60)]))[0])
        plan = sched.schedule()
        seq = sched.running[0].live[0]
        start, n = sched.kv.chunk(seq)
        assert n == blocks
        # the plan's block table is a prefix of the chunk: the prompt's 4 blocks
        assert plan.new_seqs[0].block_ids + plan.block_updates[0].block_ids == list(range(start, start + 4))


def test_contiguous_requests_wait_on_fragmentation_that_paging_does_not_have():
    # 20 blocks; chunks of 6, 4 and 6 blocks (final lengths 96, 50, 96) leave 4 free; the
    # short one finishes first: 8 blocks are free but in two holes of 4, so r3 (7 blocks) waits.
    lengths = [(40, 56), (40, 10), (40, 56), (60, 52)]
    trace = _trace(lengths, gap=0.0)
    snaps: list = []
    _, run, sizes = _sim("orca-oracle", trace, num_blocks=20, snapshots=snaps, space="first-fit")
    assert max(sizes) == 3  # r3 never ran beside the other three
    assert any(waiting and free >= 7 and hole < 7 for waiting, free, hole in snaps)
    assert run.finish_time["r3"] > min(run.finish_time["r0"], run.finish_time["r2"])
    _, run_paged, sizes_paged = _sim("paged", trace, num_blocks=20)
    assert max(sizes_paged) == 4  # 3 + 3 + 3 + 4 prompt blocks fit at once
    assert run_paged.finish_time["r3"] < run.finish_time["r3"]


def test_paged_batches_more_than_oracle_when_memory_binds():
    from pagedserve.bench.workloads import synthetic_trace

    trace = synthetic_trace("sharegpt", 60, 20.0, seed=2)
    _, _, paged = _sim("paged", trace, num_blocks=400)
    _, _, oracle = _sim("orca-oracle", trace, num_blocks=400)
    assert sum(paged) / len(paged) > 1.2 * sum(oracle) / len(oracle)


def test_fork_is_refused():
    from testing.sim.baseline_allocators import ContiguousKVCacheManager

    kv = ContiguousKVCacheManager("oracle", 16, 100, 2048)
    with pytest.raises(RuntimeError, match="cannot share"):
        kv.fork(None, None)
