"""Block-level sharing models (testing/sim/sharing_model.py) and the scheduler's sharing measured against them
(benchmarks/sharing_savings.py)."""

from __future__ import annotations

import numpy as np
import pytest

from testing.sim.sharing_model import BlockModel, beam_usage, parallel_usage


def test_fork_shares_and_cow_copies_only_a_shared_partial_block():
    pool = BlockModel(block_size=4)
    a = pool.new_seq(6)  # blocks: [full, 2/4]
    b = pool.fork(a)
    assert pool.physical == 2
    pool.append(a)  # last block shared and partly filled: copy-on-write
    assert pool.num_copies == 1 and pool.physical == 3
    pool.append(b)  # b now holds the old last block alone: write in place
    assert pool.num_copies == 1 and pool.physical == 3
    pool.drop(a)
    assert pool.physical == 2  # the shared full block survives through b
    pool.drop(b)
    assert pool.physical == 0


def test_parallel_usage_by_hand():
    # prompt of 32 tokens = 2 full shared blocks; one output token each opens a private block
    logical, physical = parallel_usage(32, 1, n=2, block_size=16)
    assert (logical, physical) == (6, 4)


def test_no_sharing_without_siblings():
    logical, physical = parallel_usage(40, 30, n=1)
    assert logical == physical
    logical, physical = beam_usage(40, 30, 1, np.random.default_rng(0))
    assert logical == physical


def test_savings_grow_with_width():
    rng = np.random.default_rng(1)
    par = [1 - p / lg for lg, p in (parallel_usage(100, 60, n) for n in (2, 4, 6))]
    beam = [1 - p / lg for lg, p in (beam_usage(100, 60, w, rng) for w in (2, 4, 6))]
    assert 0 < par[0] < par[1] < par[2] < 1
    assert 0 < beam[0] < beam[1] < beam[2] < 1
    # beams share their histories too, not only the prompt
    assert beam[0] > par[0]


@pytest.mark.parametrize("mode", ["parallel", "beam"])
def test_scheduler_sharing_matches_the_block_model(mode):
    from testing.sim.sharing_model import measure

    row = measure("alpaca", mode, 4, 12, seed=3)
    assert row["preemptions"] == 0
    assert row["saving"] > 0.05
    # the scheduler's fork/CoW/prune bookkeeping agrees with the explicit block model
    assert row["saving"] == pytest.approx(row["model_saving"], abs=0.03)
