"""Verification of proposed tokens: greedy equals plain decoding, sampling keeps the target's law."""

from __future__ import annotations

import random

import pytest
import torch

from executor_svc.speculative.rejection import seeded_uniforms, verify_greedy, verify_point_mass

# chi-square critical values at significance 0.001 (df -> value): a correct sampler fails 1 in 1000
_CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def _chi_square(counts: list[int], probs: list[float]) -> float:
    n = sum(counts)
    return sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs, strict=True) if p > 0)


def test_greedy_accepts_matching_prefix_then_the_target_token():
    assert verify_greedy([3, 4, 5], [3, 4, 9, 1]) == [3, 4, 9]
    assert verify_greedy([3, 4, 5], [3, 4, 5, 6]) == [3, 4, 5, 6]  # all accepted + bonus
    assert verify_greedy([3, 4, 5], [8, 4, 5, 6]) == [8]
    assert verify_greedy([], [2]) == [2]


def test_greedy_output_equals_plain_greedy_decoding_for_any_proposal():
    # a fixed deterministic "model": next token = f(last two tokens); decoding with proposals of any
    # quality (true continuation cut at random, or garbage) must produce the same stream
    def next_token(seq):
        return (seq[-1] * 7 + seq[-2] * 3 + 1) % 11

    def plain(prompt, n):
        seq = list(prompt)
        while len(seq) < len(prompt) + n:
            seq.append(next_token(seq))
        return seq[len(prompt):]

    rng = random.Random(0)
    for _ in range(200):
        prompt = [rng.randrange(11) for _ in range(3)]
        want = plain(prompt, 30)
        seq = list(prompt)
        while len(seq) < len(prompt) + 30:
            k = rng.randint(1, 6)
            truth = plain(seq, k)
            good = rng.randint(0, k)  # the proposal is right for `good` tokens, then wrong
            proposals = truth[:good] + [(t + 1) % 11 for t in truth[good:]]
            scored = [next_token(seq + proposals[:i]) for i in range(k + 1)]
            seq += verify_greedy(proposals, scored)
        assert seq[len(prompt):len(prompt) + 30] == want


def test_rejected_proposal_is_never_the_correction():
    probs = torch.tensor([[0.5, 0.5, 0.0], [1 / 3, 1 / 3, 1 / 3]])
    for u in (0.0, 0.3, 0.999):
        assert verify_point_mass([0], probs, [0.9], [u, 0.5]) == [1]  # 0.9 >= p(0): rejected, 1 drawn


def test_all_accepted_gives_the_bonus_from_the_last_row():
    probs = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert verify_point_mass([1, 2], probs, [0.99, 0.99], [0.1, 0.1, 0.7]) == [1, 2, 0]


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="probs"):
        verify_point_mass([1, 2], torch.ones(2, 4) / 4, [0.1, 0.1], [0.1, 0.1, 0.1])
    with pytest.raises(ValueError, match="target_argmax"):
        verify_greedy([1], [1])


def test_seeded_verification_is_reproducible_and_depends_on_the_seed():
    probs = torch.softmax(torch.randn(5, 50, generator=torch.Generator().manual_seed(1)), dim=-1)
    proposals = [3, 7, 7, 1]
    runs = {seed: verify_point_mass(proposals, probs, *seeded_uniforms(seed, 10, 5)) for seed in range(40)}
    again = {seed: verify_point_mass(proposals, probs, *seeded_uniforms(seed, 10, 5)) for seed in range(40)}
    assert runs == again
    assert len({tuple(v) for v in runs.values()}) > 1


# Two-token law: the target draws t0 ~ P0 then t1 ~ P1[t0]. Speculation proposes a fixed pair
# (a point mass, as the n-gram proposer does) and scores both positions in one "forward": row 0 is
# P0, row 1 is P1[proposal 0] (the target conditioned on the proposal), row 2 is unused here. The
# emitted first token, and the second where it comes from the same step, must follow the target.
_P0 = [0.1, 0.4, 0.3, 0.2]
_P1 = [[0.25, 0.25, 0.25, 0.25], [0.7, 0.1, 0.1, 0.1], [0.05, 0.05, 0.45, 0.45], [0.3, 0.3, 0.2, 0.2]]


def _draw_pair(seed: int, proposals: list[int], sampler=verify_point_mass) -> tuple[int, int]:
    rng = random.Random(seed)
    probs = torch.tensor([_P0, _P1[proposals[0]], [0.25] * 4], dtype=torch.float64)
    out = sampler(proposals, probs, *seeded_uniforms(seed, 0, 3))
    if len(out) == 1:  # rejected at 0: the next step draws t1 from the target given t0, plainly
        p1 = _P1[out[0]]
        out.append(rng.choices(range(4), weights=p1)[0])
    return out[0], out[1]


@pytest.mark.parametrize("proposals", [[1, 0], [0, 3], [2, 2]])
def test_sampled_output_follows_the_target_distribution_chi_square(proposals):
    n = 20000
    counts = [0] * 16
    for seed in range(n):
        t0, t1 = _draw_pair(seed, proposals)
        counts[t0 * 4 + t1] += 1
    joint = [_P0[a] * _P1[a][b] for a in range(4) for b in range(4)]
    nonzero = sum(1 for p in joint if p > 0)
    stat = _chi_square(counts, joint)
    assert stat < 37.70, f"chi-square {stat:.1f} over {nonzero - 1} df (critical 37.70 at 0.001 for df 15)"


def test_chi_square_catches_a_sampler_that_does_not_remove_the_rejected_token():
    def broken(proposals, probs, accept_u, draw_u):  # resamples from p, not from (p - q)+
        x = proposals[0]
        if accept_u[0] < float(probs[0, x]):
            return [x, proposals[1] if accept_u[1] < float(probs[1, proposals[1]]) else 0]
        cdf = torch.cumsum(probs[0], 0)
        return [min(int(torch.searchsorted(cdf, torch.tensor([draw_u[0]], dtype=cdf.dtype), right=True)), 3)]

    n = 20000
    counts = [0] * 4
    for seed in range(n):
        counts[_draw_pair(seed, [1, 0], sampler=broken)[0]] += 1
    assert _chi_square(counts, _P0) > _CHI2_999[3]
