"""The --speculative-config knob and the n-gram (prompt lookup) proposer."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.sched.speculation import (
    NgramProposer,
    SpeculativeConfig,
    TokenMirror,
    parse_speculative_config,
)


def test_parse_accepts_vllm_ngram_form():
    cfg = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 5, '
                                   '"prompt_lookup_max": 4, "prompt_lookup_min": 2}')
    assert cfg == SpeculativeConfig("ngram", 5, 4, 2)


@pytest.mark.parametrize("text, field", [
    ('{"method": "medusa", "num_speculative_tokens": 4}', "method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 17}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2.5}', "num_speculative_tokens"),
    ('{"method": "ngram", "prompt_lookup_min": 3, "prompt_lookup_max": 2}', "prompt_lookup_max"),
    ('{"method": "ngram", "prompt_lookup_min": 0}', "prompt_lookup_min"),
    # one bound given: the other takes its value, and a bad value is named as the field given
    ('{"method": "ngram", "prompt_lookup_max": 65}', "prompt_lookup_max"),
    ('{"method": "ngram", "prompt_lookup_max": 0}', "prompt_lookup_max"),
    ('{"method": "ngram", "prompt_lookup_max": "3"}', "prompt_lookup_max"),
    ('{"method": "ngram", "prompt_lookup_min": 65}', "prompt_lookup_min"),
    ('{"method": "ngram", "lookahead": 2}', "lookahead"),
    ('{"model": "/some/draft", "prompt_lookup_max": 2}', "prompt_lookup_max"),  # an n-gram field
    ('{"method": "ngram", "model": "/some/draft"}', "model"),
    ('{"method": "draft_model", "num_speculative_tokens": 4}', "model"),
    ('{"model": "", "num_speculative_tokens": 4}', "model"),
    ('{"model": "/some/draft", "num_speculative_tokens": 0}', "num_speculative_tokens"),
    ('[1, 2]', "JSON object"),
    ('{method: ngram}', "JSON object"),
    ('{"method": "ngram", "max_verified_tokens": 1}', "max_verified_tokens"),
    ('{"model": "/some/draft", "max_verified_tokens": "32"}', "max_verified_tokens"),
])
def test_parse_rejects_bad_input_naming_the_field(text, field):
    with pytest.raises(ValueError, match=field):
        parse_speculative_config(text)


def test_parse_accepts_vllm_draft_model_form():
    cfg = parse_speculative_config('{"model": "/models/draft", "num_speculative_tokens": 3}')
    assert (cfg.method, cfg.model, cfg.num_speculative_tokens) == ("draft_model", "/models/draft", 3)
    assert parse_speculative_config('{"method": "draft_model", "model": "/d"}').model == "/d"


def test_the_verified_positions_budget_is_configurable():
    assert parse_speculative_config('{"method": "ngram"}').max_verified_tokens == 32
    assert parse_speculative_config('{"method": "ngram", "max_verified_tokens": 8}').max_verified_tokens == 8
    assert parse_speculative_config('{"model": "/d", "max_verified_tokens": 64}').max_verified_tokens == 64


def test_k_limits_name_the_range():
    with pytest.raises(ValueError, match=r"1\.\.16"):
        parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 17}')


def _proposer(k=4, lo=1, hi=4):
    return NgramProposer(SpeculativeConfig("ngram", k, hi, lo))


def test_proposes_what_followed_the_suffix_earlier():
    #        0  1  2  3  4  5  6  7  8  9
    tokens = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert _proposer(k=3).propose(tokens) == [8, 9, 1]


def test_longest_match_wins_over_a_more_recent_shorter_one():
    # suffix [1, 2, 3]: matched in full at 0 (-> 40); the later [2, 3] at 5 would propose 50
    tokens = [1, 2, 3, 40, 41, 2, 3, 50, 51, 1, 2, 3]
    assert _proposer(k=2, lo=1, hi=3).propose(tokens) == [40, 41]


def test_most_recent_occurrence_for_equal_length():
    tokens = [7, 8, 1, 9, 9, 7, 8, 2, 3, 3, 7, 8]
    assert _proposer(k=2, lo=2, hi=2).propose(tokens) == [2, 3]


def test_proposal_is_cut_at_the_sequence_end_and_empty_without_a_match():
    p = _proposer(k=4, lo=2, hi=3)
    assert p.propose([1, 2, 3, 1, 2]) == [3, 1, 2]
    assert p.propose([1, 2, 3, 4, 5]) == []
    assert p.propose([1]) == []
    assert p.propose([]) == []


def test_min_n_is_respected():
    # only a 1-gram matches: with prompt_lookup_min 2 nothing is proposed
    tokens = [4, 9, 1, 2, 3, 9]
    assert _proposer(lo=1, hi=3).propose(tokens) == [1, 2, 3, 9]
    assert _proposer(lo=2, hi=3).propose(tokens) == []


def test_repeated_text_is_proposed_in_full():
    prompt = list(range(100, 140))
    out = prompt[:10]  # the model is copying the prompt
    assert _proposer(k=8, lo=2, hi=4).propose(prompt + out) == prompt[10:18]


def test_k_override():
    assert _proposer(k=4).propose([1, 2, 3, 4, 1], k=2) == [2, 3]


def _by_definition(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """Prompt lookup as specified: for n from the longest down, the most recent earlier n-gram equal
    to the sequence's last n tokens (not the suffix itself); what followed it."""
    total = len(tokens)
    for n in range(min(hi, total - 1), lo - 1, -1):
        suffix = tokens[total - n:]
        for start in range(total - n - 1, -1, -1):
            if tokens[start:start + n] == suffix:
                return tokens[start + n:start + n + k]
    return []


@settings(max_examples=400, deadline=None)
@given(tokens=st.lists(st.integers(0, 4), max_size=40), k=st.integers(1, 5), room=st.integers(0, 5),
       lo=st.integers(1, 4), extra=st.integers(0, 3))
def test_the_lookup_equals_its_definition(tokens, k, room, lo, extra):
    """A small alphabet makes repeats, ties and overlapping matches common."""
    proposer = _proposer(k=k, lo=lo, hi=lo + extra)
    assert proposer.propose(tokens) == _by_definition(tokens, k, lo, lo + extra)
    assert proposer.propose(tokens, room) == _by_definition(tokens, room, lo, lo + extra)


def test_the_mirror_grows_with_the_tokens_and_proposes_as_the_list_does():
    mirror, proposer = TokenMirror(), _proposer(k=3)
    tokens = [5, 6, 7, 8, 9]
    for t in [1, 2, 5, 6, 7] + list(range(100, 300)):  # (past the first buffer: it grows)
        tokens.append(t)
        view = mirror.view(0, tokens)
        assert view.tolist() == tokens
        assert proposer.propose(view) == proposer.propose(tokens)
    assert mirror.view(1, [4, 4]).tolist() == [4, 4] and len(mirror) == 2
    assert mirror.view(1, [3, 9, 4]).tolist() == [3, 9, 4]  # (its last mirrored token differs: rebuilt)
    assert mirror.view(1, [3]).tolist() == [3]
    mirror.forget(0)
    mirror.forget(1)
    assert len(mirror) == 0
