"""Orca-style contiguous reservation: policies, first-fit ranges, fragmentation."""

from __future__ import annotations

import random

import pytest

from benchmarks.baseline_allocators import (
    FirstFitSpace,
    ReservationPolicy,
    next_pow2,
    reservation_slots,
)


def test_reservation_policies():
    assert reservation_slots(ReservationPolicy.MAX, 100, 2048) == 2048
    assert reservation_slots(ReservationPolicy.POW2, 100, 2048) == 128
    assert reservation_slots(ReservationPolicy.POW2, 128, 2048) == 128
    assert reservation_slots(ReservationPolicy.POW2, 1500, 2048) == 2048
    assert reservation_slots(ReservationPolicy.ORACLE, 100, 2048) == 100
    assert [next_pow2(n) for n in (1, 2, 3, 5, 1024, 1025)] == [1, 2, 4, 8, 1024, 2048]


def test_reservation_rejects_lengths_beyond_the_model():
    with pytest.raises(ValueError, match="final_len"):
        reservation_slots(ReservationPolicy.ORACLE, 2049, 2048)


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
    rng = random.Random(3)
    space = FirstFitSpace(500)
    live: list[int] = []
    for _ in range(3000):
        if live and rng.random() < 0.5:
            space.free(live.pop(rng.randrange(len(live))))
        else:
            start = space.allocate(rng.randint(1, 60))
            if start is not None:
                live.append(start)
        space.check_integrity()
    assert space.largest_hole() <= space.num_free
