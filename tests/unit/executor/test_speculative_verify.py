"""executor_svc/speculative/verify.py on its own: the emitted tokens of a sampled sequence follow the
target's distribution at every position (a chi-square test over many unseeded draws on a
4-token vocabulary), whatever is proposed; greedy keeps proposals exactly while they are the
argmax."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from executor_svc.batch import SeqState
from executor_svc.sampler import SampleOutput, Sampler
from executor_svc.speculative.verify import verify_proposals
from pagedserve.wire import SamplingParams

P0 = torch.tensor([0.1, 0.2, 0.3, 0.4])  # the target at the first verified position
P1 = torch.tensor([0.25, 0.05, 0.6, 0.1])  # and after the proposal (token 2) was accepted
CHI2_DF3_P001 = 16.27  # chi-square critical value, 3 degrees of freedom, p = 0.001


def _verify(sampler: Sampler, sampling: SamplingParams, proposals: list[int], rows: list[torch.Tensor]):
    s = SeqState(0, [1, 2, 3] + proposals, 3, [0], 3, sampling)
    s.proposals = list(proposals)
    batch = SimpleNamespace(spec=[(s, proposals, 0)], spec_logits=[torch.stack(rows[:-1])])
    out = SampleOutput([None], [None], [None])
    extras = verify_proposals(sampler, batch, [rows[-1].clone()], out, {0: 0})
    assert s.token_ids == [1, 2, 3] and s.proposals is None  # left as before the proposals
    return [out.token_ids[0], *extras[0][0]]


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    expected = p * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("proposal", [2, 0])  # likely and unlikely under P0
def test_sampled_tokens_follow_the_target_at_each_position(proposal):
    sampler = Sampler(seed=1234)
    sampling = SamplingParams(temperature=1.0)
    first = torch.zeros(4)
    second = torch.zeros(4)
    for _ in range(6000):
        toks = _verify(sampler, sampling, [proposal], [P0.log(), P1.log()])
        first[toks[0]] += 1
        if toks[0] == proposal:  # accepted: the next token is drawn from the next position's target
            assert len(toks) == 2
            second[toks[1]] += 1
        else:
            assert len(toks) == 1  # rejected: the correction is the last token emitted
    assert _chi2(first, P0) < CHI2_DF3_P001, first
    assert _chi2(second, P1) < CHI2_DF3_P001, second
    assert abs(float(first[proposal]) / 6000 - float(P0[proposal])) < 0.03  # acceptance is p(proposal)


def test_greedy_keeps_proposals_while_they_are_the_argmax():
    rows = [torch.tensor([0.0, 1.0, 5.0, 2.0]), torch.tensor([3.0, 0.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 0.0, 9.0])]
    greedy = SamplingParams(temperature=0.0)
    assert _verify(Sampler(), greedy, [2, 0], rows) == [2, 0, 3]  # both accepted, then the bonus
    assert _verify(Sampler(), greedy, [2, 1], rows) == [2, 0]  # the second rejected: the target's own token
    assert _verify(Sampler(), greedy, [1, 0], rows) == [2]  # the first rejected


def test_a_plan_proposing_for_a_beam_sequence_is_refused(tiny_llama_dir):
    """Verification samples one token per position: proposals for a beam sequence (which scores
    candidates instead) cannot be verified, so the executor refuses such a plan whole. (A constrained
    sequence's are verified under its grammar: test_speculative_structured.py.)"""
    from pagedserve.wire import BatchPlan, NewSeq, Proposal, pack_ids
    from testing.executor_plans import make_runner

    runner = make_runner(tiny_llama_dir, num_blocks=8)
    beam = SamplingParams(temperature=0.0, beam_candidates=2)
    plan = BatchPlan(0, [1], [1], new_seqs=[NewSeq(1, pack_ids([5, 6, 7]), 3, [0], 2, beam)],
                     proposals=[Proposal(1, [8, 9])])
    res = runner.execute(plan)
    assert res.refused and "proposals: seq 1" in res.error and res.failed_seq_ids == [1]


Q0 = torch.tensor([0.5, 0.3, 0.1, 0.1])  # a draft's distribution at the first position (far from P0)
Q1 = torch.tensor([0.1, 0.1, 0.1, 0.7])


def _verify_draft(sampler: Sampler, sampling: SamplingParams, proposals: list[int], qs: list[torch.Tensor],
                  rows: list[torch.Tensor]):
    s = SeqState(0, [1, 2, 3] + proposals, 3, [0], 3, sampling)
    s.proposals, s.drafted, s.draft_q, s.draft_computed = list(proposals), True, list(qs), 3 + len(proposals) - 1
    batch = SimpleNamespace(spec=[(s, proposals, 0)], spec_logits=[torch.stack(rows[:-1])])
    out = SampleOutput([None], [None], [None])
    extras = verify_proposals(sampler, batch, [rows[-1].clone()], out, {0: 0})
    toks = [out.token_ids[0], *extras[0][0]]
    assert s.token_ids == [1, 2, 3] and s.draft_q is None and not s.drafted
    assert s.draft_computed == 3 + min(len(toks) - 1, len(proposals) - 1)  # committed + accepted drafts
    return toks


def test_draft_proposals_with_their_distribution_follow_the_target_by_the_p_over_q_rule():
    """Proposals drawn from q: accepted with min(1, p/q), else the residual norm(max(0, p - q)) is
    drawn; each emitted token follows the target (chi-square), and the acceptance rate of the first
    proposal is sum_x min(p(x), q(x)) (0.6 here, where a point-mass rule would give sum q p = 0.18)."""
    sampler = Sampler(seed=99)
    sampling = SamplingParams(temperature=1.0)
    gen = torch.Generator().manual_seed(3)
    first, second, third = torch.zeros(4), torch.zeros(4), torch.zeros(4)
    accepted = 0
    n = 8000
    for _ in range(n):
        d0 = int(torch.multinomial(Q0, 1, generator=gen))
        d1 = int(torch.multinomial(Q1, 1, generator=gen))
        toks = _verify_draft(sampler, sampling, [d0, d1], [Q0, Q1], [P0.log(), P1.log(), P0.log()])
        first[toks[0]] += 1
        if len(toks) > 1:  # the first proposal was accepted (else its correction ends the step)
            assert toks[0] == d0
            accepted += 1
            second[toks[1]] += 1
            if len(toks) == 3:
                third[toks[2]] += 1  # the bonus token, from the last row
    assert _chi2(first, P0) < CHI2_DF3_P001, first
    assert _chi2(second, P1) < CHI2_DF3_P001, second
    assert _chi2(third, P0) < CHI2_DF3_P001, third
    assert abs(accepted / n - float(torch.minimum(P0, Q0).sum())) < 0.02


def test_seeded_draft_verification_is_reproducible():
    sampling = SamplingParams(temperature=1.0, seed=5)
    runs = [[_verify_draft(Sampler(seed=s), sampling, [1, 3], [Q0, Q1], [P0.log(), P1.log(), P0.log()])
             for _ in range(3)] for s in (1, 2)]
    assert runs[0] == runs[1]  # the seed's streams, not the sampler's generator, decide
