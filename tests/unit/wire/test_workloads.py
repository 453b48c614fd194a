"""Synthetic traces: the paper's length statistics, bounds, Poisson arrivals, seeding."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.bench.workloads import (
    ALPACA,
    SHAREGPT,
    poisson_arrivals,
    sample_lengths,
    shared_prefix_trace,
    synthetic_trace,
    trace_stats,
)


@pytest.mark.parametrize("dist", [SHAREGPT, ALPACA], ids=lambda d: d.name)
def test_length_means_match_the_paper(dist):
    prompts, outputs = sample_lengths(dist, 40_000, np.random.default_rng(7))
    assert prompts.mean() == pytest.approx(dist.input_mean, rel=0.04)
    assert outputs.mean() == pytest.approx(dist.output_mean, rel=0.04)


@pytest.mark.parametrize("dist", [SHAREGPT, ALPACA], ids=lambda d: d.name)
def test_lengths_respect_model_limits(dist):
    prompts, outputs = sample_lengths(dist, 40_000, np.random.default_rng(8))
    assert prompts.min() >= 1 and outputs.min() >= 1
    assert prompts.max() <= dist.max_prompt
    assert (prompts + outputs).max() <= dist.max_total


def test_sharegpt_is_right_skewed_and_longer_than_alpaca():
    rng = np.random.default_rng(9)
    p_s, o_s = sample_lengths(SHAREGPT, 20_000, rng)
    p_a, o_a = sample_lengths(ALPACA, 20_000, rng)
    # right skew: the mean sits well above the median
    assert o_s.mean() > 1.3 * np.median(o_s)
    assert p_s.mean() > 1.3 * np.median(p_s)
    # the paper: ShareGPT inputs ~8.4x and outputs ~5.8x longer than Alpaca's
    assert 6 < p_s.mean() / p_a.mean() < 11
    assert 4.5 < o_s.mean() / o_a.mean() < 7.5


def test_poisson_arrivals_rate_and_exponential_gaps():
    times = poisson_arrivals(4.0, 20_000, np.random.default_rng(10))
    gaps = np.diff(np.concatenate([[0.0], times]))
    assert np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    # exponential: std equals mean
    assert gaps.std() == pytest.approx(gaps.mean(), rel=0.05)


def test_poisson_rejects_bad_rate():
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(0.0, 3, np.random.default_rng(0))


def test_trace_is_reproducible_and_seed_dependent():
    a = synthetic_trace("sharegpt", 200, 2.0, seed=5)
    b = synthetic_trace("sharegpt", 200, 2.0, seed=5)
    c = synthetic_trace("sharegpt", 200, 2.0, seed=6)
    assert a == b
    assert [r.output_len for r in a] != [r.output_len for r in c]
    assert all(x.arrival_time < y.arrival_time for x, y in zip(a, a[1:], strict=False))
    assert len({r.request_id for r in a}) == 200


def test_trace_stats_report_rate_and_means():
    trace = synthetic_trace(ALPACA, 4000, 30.0, seed=1)
    stats = trace_stats(trace)
    assert stats["rate"] == pytest.approx(30.0, rel=0.06)
    assert stats["input_mean"] == pytest.approx(ALPACA.input_mean, rel=0.08)
    assert all(4 <= t < 50272 for r in trace[:50] for t in r.prompt_token_ids)


def test_shared_prefix_trace_shares_a_few_long_prefixes():
    trace = shared_prefix_trace(300, 5.0, seed=2, num_prefixes=3, prefix_len=256)
    prefixes = {r.prompt_token_ids[:256] for r in trace}
    assert len(prefixes) == 3
    assert {r.prefix_id for r in trace} == {0, 1, 2}
    for r in trace:
        assert r.prompt_len > 256 and r.prompt_len <= ALPACA.max_prompt
        assert r.prompt_len + r.output_len <= ALPACA.max_total
    # requests naming the same prefix id really share its tokens
    by_id = {}
    for r in trace:
        assert by_id.setdefault(r.prefix_id, r.prompt_token_ids[:256]) == r.prompt_token_ids[:256]
