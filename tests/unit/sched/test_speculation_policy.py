"""The adaptation rules: a sequence whose proposals fail stops proposing, then probes; a large
batch does not speculate."""

from __future__ import annotations

import pytest

from scheduler_svc.sched.speculation_policy import SpeculationPolicy


def _steps_proposing(policy: SpeculationPolicy, sid: int, steps: int, accept) -> int:
    n = 0
    for i in range(steps):
        if policy.wants_proposals(sid):
            n += 1
            policy.observe(sid, 4, accept(i))
    return n


def test_a_sequence_that_accepts_keeps_proposing():
    p = SpeculationPolicy(k=4)
    assert _steps_proposing(p, 1, 100, lambda i: 3) == 100


def test_a_sequence_that_never_accepts_mostly_stops_and_backs_off():
    p = SpeculationPolicy(k=4, first_backoff=8, max_backoff=64)
    proposing = _steps_proposing(p, 1, 1000, lambda i: 0)
    assert proposing < 40  # a few steps to notice, then probes ever further apart
    assert p.acceptance(1) < 0.5


def test_probes_find_repetition_that_starts_later():
    p = SpeculationPolicy(k=4, first_backoff=8, max_backoff=64)
    _steps_proposing(p, 1, 200, lambda i: 0)
    # from now on every proposal is accepted: after at most one back-off it proposes every step
    waited = next(i for i in range(65) if p.wants_proposals(1))
    assert waited <= 64
    p.observe(1, 4, 4)
    assert _steps_proposing(p, 1, 50, lambda i: 4) == 50


def test_sequences_are_independent_and_forgotten():
    p = SpeculationPolicy(k=4)
    _steps_proposing(p, 1, 50, lambda i: 0)
    assert _steps_proposing(p, 2, 20, lambda i: 4) == 20
    p.forget(1)
    assert p.wants_proposals(1) and p.acceptance(1) == 1.0


@pytest.mark.parametrize("n, budget, room", [(1, 32, 31), (16, 32, 16), (31, 32, 1), (32, 32, 0), (40, 32, 0),
                                              (4, 256, 252)])
def test_a_step_verifies_at_most_its_budget_and_a_large_batch_none(n, budget, room):
    assert SpeculationPolicy(k=4, max_verified_tokens=budget).proposal_room(n) == room


def test_bad_threshold_is_named():
    with pytest.raises(ValueError, match="min_acceptance"):
        SpeculationPolicy(k=4, min_acceptance=1.5)
