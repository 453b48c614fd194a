"""The suite runs in pytest-xdist workers (make test): the ports each worker picks for its servers
(testing/stack.py) must never be ones another worker may pick, nor lie in another's port runs."""

from __future__ import annotations

import pytest

from testing import stack


def _ours(monkeypatch, worker: int, workers: int) -> set[int]:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
    return {p for p in range(1024, 65536) if stack.port_is_ours(p)}


@pytest.mark.parametrize("workers", [2, 3, 8])
def test_workers_pick_from_disjoint_slices_with_room_for_a_run(monkeypatch, workers):
    picks = [_ours(monkeypatch, k, workers) for k in range(workers)]
    for k, mine in enumerate(picks):
        assert mine, f"worker {k} of {workers} has no port"
        runs = {p + i for p in mine for i in range(stack.RUN_ROOM)}  # a pick and the ports after it
        others = set().union(*(picks[j] for j in range(workers) if j != k))
        assert not runs & others, f"worker {k}'s port runs meet another worker's picks"


def test_free_ports_keep_to_the_workers_slices(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    assert all(stack.port_is_ours(p) for p in [stack.free_port() for _ in range(20)] + stack.free_ports(3))


def test_outside_xdist_every_port_may_be_picked(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    assert all(stack.port_is_ours(p) for p in range(1024, 65536, 7))
