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


def test_a_plan_proposing_for_a_constrained_sequence_is_refused(tiny_llama_dir):
    """Verification samples without a grammar: proposals for a structured-output or beam sequence
    would emit unconstrained tokens, so the executor refuses such a plan whole."""
    from pagedserve.wire import BatchPlan, NewSeq, Proposal, pack_ids
    from testing.executor_plans import make_runner

    runner = make_runner(tiny_llama_dir, num_blocks=8)
    beam = SamplingParams(temperature=0.0, beam_candidates=2)
    plan = BatchPlan(0, [1], [1], new_seqs=[NewSeq(1, pack_ids([5, 6, 7]), 3, [0], 2, beam)],
                     proposals=[Proposal(1, [8, 9])])
    res = runner.execute(plan)
    assert res.refused and "proposals: seq 1" in res.error and res.failed_seq_ids == [1]
