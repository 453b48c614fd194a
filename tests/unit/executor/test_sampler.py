"""The batched sampler: seeds, truncation sets, penalties, logprobs, beam mode."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from executor_svc.sampler import Sampler, apply_penalties, seeded_uniform
from pagedserve.wire import SamplingParams

VOCAB = 50


@dataclass
class Row:
    sampling: SamplingParams
    token_ids: list[int] = field(default_factory=lambda: [1, 2, 3])
    num_prompt_tokens: int = 3


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_seeded_uniform_depends_only_on_seed_and_position():
    assert seeded_uniform(7, 3) == seeded_uniform(7, 3)
    values = {seeded_uniform(s, j) for s in range(20) for j in range(20)}
    assert len(values) == 400 and all(0.0 <= u < 1.0 for u in values)


def test_seeded_draw_same_alone_and_in_any_batch():
    logits = _logits(6)
    params = [SamplingParams(temperature=0.9, top_p=0.9, seed=s) for s in range(6)]
    batched = Sampler().sample(logits.clone(), [Row(p) for p in params]).token_ids
    for i, p in enumerate(params):
        alone = Sampler().sample(logits[i:i + 1].clone(), [Row(p)]).token_ids
        assert alone == [batched[i]]
    rev = Sampler().sample(logits.flip(0).clone(), [Row(p) for p in reversed(params)]).token_ids
    assert rev[::-1] == batched
    # Different output positions draw different numbers: over positions the tokens vary.
    tokens = {Sampler().sample(logits[:1].clone(), [Row(params[0], [1] * (3 + j))]).token_ids[0]
              for j in range(40)}
    assert len(tokens) > 3


def test_a_seeded_row_draws_the_same_beside_rows_that_truncate():
    """A row without top-k/p or min-p draws over the vocabulary in its own order whatever its
    neighbours ask: sorted because another row truncates, the same uniform number found another
    token (issue #43)."""
    logits = _logits(20, seed=3)
    params = [SamplingParams(temperature=1.0, seed=s, top_k=5 if s % 2 else 0, min_p=0.05 if s % 4 == 1 else 0.0)
              for s in range(20)]
    batched = Sampler().sample(logits.clone(), [Row(p) for p in params])
    for i, p in enumerate(params):
        alone = Sampler().sample(logits[i:i + 1].clone(), [Row(p)]).token_ids
        assert alone == [batched.token_ids[i]], f"row {i} ({p.top_k=}, {p.min_p=})"


def test_unseeded_rows_vary():
    logits = (_logits(1) / 3).repeat(200, 1)  # a flat distribution
    rows = [Row(SamplingParams(temperature=1.0)) for _ in range(200)]
    assert len(set(Sampler().sample(logits, rows).token_ids)) > 5


def test_sampling_frequencies_follow_the_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    n = 4000
    rows = [Row(SamplingParams(temperature=0.7, seed=s)) for s in range(n)]
    toks = Sampler().sample(logits.repeat(n, 1), rows).token_ids
    freq = torch.bincount(torch.tensor(toks), minlength=5).float() / n
    assert torch.allclose(freq, torch.softmax(logits[0] / 0.7, -1), atol=0.03)


def _allowed(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Reference truncation, token by token, written independently of the sampler."""
    scaled = logits / p.temperature
    order = sorted(range(len(scaled)), key=lambda t: -float(scaled[t]))
    if p.top_k > 0:
        order = order[:p.top_k]
    probs = torch.softmax(scaled[order], 0).tolist()
    kept, total = [], 0.0
    for t, pr in zip(order, probs, strict=True):
        if total >= p.top_p and kept:
            break
        if pr < p.min_p * probs[0]:
            break
        kept.append(t)
        total += pr
    return set(kept)


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=1.0, top_k=3),
    SamplingParams(temperature=1.5, top_p=0.5),
    SamplingParams(temperature=2.0, min_p=0.2),
    SamplingParams(temperature=1.0, top_k=10, top_p=0.8, min_p=0.05),
])
def test_truncation_never_leaves_the_allowed_set(params):
    logits = _logits(1, seed=3)[0]
    allowed = _allowed(logits, params)
    n = 600
    rows = [Row(SamplingParams(**{**_fields(params), "seed": s})) for s in range(n)]
    seen = set(Sampler().sample(logits.repeat(n, 1), rows).token_ids)
    assert seen <= allowed
    assert len(seen) >= min(2, len(allowed))  # it does sample, not just the argmax


def _fields(p: SamplingParams) -> dict:
    return {k: getattr(p, k) for k in p.__slots__}


def test_greedy_is_argmax_with_logprobs_of_the_penalised_distribution():
    logits = _logits(3, seed=5)
    rows = [Row(SamplingParams(temperature=0.0, want_logprobs=True, logprobs=4, processed_logprobs=True))
            for _ in range(3)]
    out = Sampler().sample(logits.clone(), rows)
    assert out.token_ids == logits.argmax(-1).tolist()
    for i, lp in enumerate(out.logprobs):
        ref = torch.log_softmax(logits[i], -1)
        assert lp.token_logprob == pytest.approx(float(ref.max()), abs=1e-6)
        assert lp.top_token_ids == torch.topk(ref, 4).indices.tolist()


def test_processed_logprobs_describe_the_truncated_distribution():
    logits = _logits(1, seed=6)
    p = SamplingParams(temperature=0.5, top_k=2, seed=1, want_logprobs=True, logprobs=5, processed_logprobs=True)
    out = Sampler().sample(logits.clone(), [Row(p)])
    lp = out.logprobs[0]
    top2 = torch.topk(logits[0], 2).indices.tolist()
    assert lp.top_token_ids == top2  # truncated tokens are never listed
    ref = torch.log_softmax(logits[0, top2] / 0.5, -1)
    assert lp.top_logprobs == pytest.approx(ref.tolist(), abs=1e-5)
    assert lp.token_logprob == pytest.approx(float(ref[top2.index(out.token_ids[0])]), abs=1e-5)


def test_beam_mode_reports_raw_logsoftmax_and_samples_nothing():
    logits = _logits(2, seed=7)
    p = SamplingParams(temperature=0.0, beam_candidates=3, repetition_penalty=2.0)
    out = Sampler().sample(logits.clone(), [Row(p), Row(SamplingParams(temperature=0.0))])
    assert out.token_ids[0] is None and out.beam[0] is not None and out.token_ids[1] is not None
    ref = torch.topk(torch.log_softmax(logits[0], -1), 3)
    assert out.beam[0].top_token_ids == ref.indices.tolist()
    assert out.beam[0].top_logprobs == pytest.approx(ref.values.tolist(), abs=1e-6)


def test_repetition_penalty_hf_semantics_over_prompt_and_output():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0, 1.0]])
    row = Row(SamplingParams(repetition_penalty=2.0), token_ids=[0, 1, 4], num_prompt_tokens=2)
    apply_penalties(logits, [row])
    assert logits[0].tolist() == [1.0, -4.0, 2.0, -2.0, 0.5]


def test_frequency_and_presence_penalties_openai_semantics_over_output_only():
    logits = torch.zeros(1, 5)
    p = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    row = Row(p, token_ids=[3, 3, 1, 1, 1, 2], num_prompt_tokens=2)  # outputs: 1, 1, 1, 2
    apply_penalties(logits, [row])
    assert logits[0].tolist() == pytest.approx([0.0, -1.75, -0.75, 0.0, 0.0])


def test_penalties_change_the_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    rows = [Row(SamplingParams(temperature=0.0, presence_penalty=1.0), token_ids=[5, 0], num_prompt_tokens=1)]
    assert Sampler().sample(logits, rows).token_ids == [1]


# ---------------------------------------------------------------- logit bias, min_tokens, masks, logprobs modes

class _Allow:
    """Grammar masks (executor_svc/grammar.py's GrammarMasks, duck-typed): each row keeps only its ids."""

    def __init__(self, allowed: dict[int, list[int]]) -> None:
        self.allowed = allowed

    def apply(self, logits: torch.Tensor) -> None:
        for row, ids in self.allowed.items():
            keep = torch.full((logits.shape[1],), float("-inf"))
            keep[ids] = 0.0
            logits[row] += keep


def test_logit_bias_moves_the_choice_and_ignores_ids_past_the_vocabulary():
    logits = torch.tensor([[3.0, 2.9, 0.0]])
    p = SamplingParams(temperature=0.0, logit_bias=[(2, 5.0), (99, 100.0)])
    assert Sampler().sample(logits, [Row(p)]).token_ids == [2]


def test_min_tokens_holds_back_end_tokens_until_enough_outputs():
    logits = torch.tensor([[5.0, 1.0, 0.0, 4.0]])  # the best is 0, an end token
    p = SamplingParams(temperature=0.0, min_tokens=2, end_token_ids=[0, 3])
    early = Row(p, token_ids=[7, 7, 1], num_prompt_tokens=2)  # one output so far
    late = Row(p, token_ids=[7, 7, 1, 1], num_prompt_tokens=2)  # two
    assert Sampler().sample(logits.clone(), [early]).token_ids == [1]  # not 0 nor 3
    assert Sampler().sample(logits.clone(), [late]).token_ids == [0]


def test_the_grammar_mask_wins_over_min_tokens():
    logits = torch.tensor([[0.0, 5.0, 4.0], [0.0, 5.0, 4.0]])
    p = SamplingParams(temperature=0.0, min_tokens=5, end_token_ids=[0])
    rows = [Row(p), Row(p)]
    out = Sampler().sample(logits, rows, _Allow({0: [0], 1: [0, 2]}))
    assert out.token_ids == [0, 2]  # row 0's grammar allows only the end token: it is sampled anyway


def test_masks_hold_for_sampled_rows_too():
    logits = torch.zeros(64, VOCAB)
    rows = [Row(SamplingParams(temperature=1.0, seed=s)) for s in range(64)]
    out = Sampler().sample(logits, rows, _Allow({i: [3, 17] for i in range(64)}))
    assert set(out.token_ids) == {3, 17}


def test_raw_logprobs_are_the_models_own_and_processed_ones_what_was_drawn_from():
    logits = _logits(1, seed=9)
    common = dict(temperature=0.5, top_k=3, seed=2, want_logprobs=True, logprobs=4, repetition_penalty=1.5,
                  logit_bias=[(0, 2.0)])
    raw = Sampler().sample(logits.clone(), [Row(SamplingParams(**common))])
    processed = Sampler().sample(logits.clone(), [Row(SamplingParams(**common, processed_logprobs=True))])
    assert raw.token_ids == processed.token_ids
    model = torch.log_softmax(logits[0], -1)
    tok = raw.token_ids[0]
    assert raw.logprobs[0].token_logprob == pytest.approx(float(model[tok]), abs=1e-6)
    assert raw.logprobs[0].top_token_ids == torch.topk(model, 4).indices.tolist()  # truncation hides nothing
    assert len(processed.logprobs[0].top_token_ids) == 3  # top-k left three
    assert processed.logprobs[0].token_logprob > raw.logprobs[0].token_logprob


def test_greedy_ids_are_the_argmax_lowest_id_first_nan_included():
    from executor_svc.sampler import greedy_ids

    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 4, (300, 513), generator=g).float()  # many ties
    x[7, 100] = float("nan")
    x[7, 300] = float("nan")
    x[9] = 2.5  # a whole row tied
    x[11, -1] = float("inf")
    x[12] = float("-inf")
    x[13, 5], x[13, 6] = -0.0, 0.0
    x[13, 7:] = -1.0
    x[13, :5] = -1.0
    assert torch.equal(greedy_ids(x), torch.argmax(x, dim=-1))
    assert greedy_ids(x)[9] == 0 and greedy_ids(x)[7] == 100 and greedy_ids(x)[11] == 512
    assert greedy_ids(x)[12] == 0 and greedy_ids(x)[13] == 5
    # CPU float32 logits take numpy's argmax: the same ids as torch's reductions, on a strided view
    # too, over a real vocabulary's width (where numpy's vectorised loop runs), and for one row alone.
    assert greedy_ids(x).dtype == torch.int64
    assert greedy_ids(x).tolist() == x.max(dim=-1).indices.tolist()
    assert greedy_ids(x[::3, 1:]).tolist() == x[::3, 1:].max(dim=-1).indices.tolist()
    assert greedy_ids(x[7]).tolist() == 100
    wide = torch.randint(-40, 40, (6, 49_152), generator=g).float()
    wide[2, 40_000] = float("nan")
    wide[3, 49_151] = float("nan")
    wide[4] = float("-inf")
    wide[5, 17] = float("inf")
    wide[5, 30_000] = float("inf")
    assert greedy_ids(wide).tolist() == wide.max(dim=-1).indices.tolist() == torch.argmax(wide, dim=-1).tolist()
    assert greedy_ids(wide.to(torch.bfloat16)).tolist() == torch.argmax(wide.to(torch.bfloat16), dim=-1).tolist()
