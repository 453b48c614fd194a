"""Speculative decoding of constrained sequences (structured outputs): each verified position is
masked by the grammar's state after the tokens emitted before it, so the outputs equal decoding
without speculation (greedy and seeded) for JSON schemas, regexes, choices and grammars; proposals
the grammar forbids are cut where they break it (the unconstrained model's own continuation,
which its rows would otherwise accept); and the grammar state follows exactly the emitted tokens,
so the next steps' masks are right."""

from __future__ import annotations

import functools
import re

import pytest
from tokenizers import Tokenizer

from executor_svc.grammar import GrammarBackend
from executor_svc.model import load_model
from pagedserve.engine_api import RequestParams
from pagedserve.wire import SamplingParams
from scheduler_svc.sched.speculation import SpeculativeConfig
from testing.executor_plans import make_runner, with_draft
from testing.speculative_serving import OracleProposer, serve
from tests.unit.executor.test_structured_outputs import EOS, PROMPTS, SPECS

K = 4


@functools.cache
def _tokenizer(model_dir) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def backend(tiny_llama_dir, model):
    return GrammarBackend.for_model(tiny_llama_dir, model.cfg.vocab_size)


def _prompts() -> dict[str, list[int]]:
    return {f"p{i}": p for i, p in enumerate(PROMPTS)}


def _serve(tiny_llama_dir, model, backend, sampling: SamplingParams, spec=None, proposer=None):
    runner = make_runner(tiny_llama_dir, model=model, num_blocks=64)
    runner.grammar = backend
    return serve(runner, RequestParams(max_tokens=40, sampling=sampling), spec, _prompts(), proposer=proposer,
                 eos_token_ids=(EOS,))


def _sampling(kind: str, seeded: bool) -> SamplingParams:
    extra = dict(temperature=0.9, top_p=0.95, seed=11, logprobs=1, want_logprobs=True) if seeded else dict(temperature=0.0)
    return SamplingParams(**extra, structured=SPECS[kind], end_token_ids=[EOS])


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("kind", list(SPECS))
def test_constrained_outputs_are_unchanged_by_right_and_wrong_proposals(tiny_llama_dir, model, backend, kind, seeded):
    sampling = _sampling(kind, seeded)
    plain = _serve(tiny_llama_dir, model, backend, sampling)
    fast = _serve(tiny_llama_dir, model, backend, sampling, SpeculativeConfig(num_speculative_tokens=K),
                  OracleProposer(_prompts(), plain.outputs, K))
    assert fast.outputs == plain.outputs
    assert fast.logprobs == plain.logprobs  # (raw: the model's own log-probs, unmasked, on both)
    assert all(fast.logprobs.values()) == seeded
    st = fast.sched.spec.counters
    assert st.num_drafts > 0 and 0 < st.num_accepted_tokens < st.num_draft_tokens
    assert len(fast.plans) < len(plain.plans)


@pytest.mark.parametrize("kind", list(SPECS))
def test_proposals_the_grammar_forbids_are_cut(tiny_llama_dir, model, backend, kind):
    """The proposals are the unconstrained model's greedy continuation: its rows rank those tokens
    first, so only the grammar's mask at each verified position keeps them out."""
    free = _serve(tiny_llama_dir, model, backend, SamplingParams(temperature=0.0))
    constrained = _serve(tiny_llama_dir, model, backend, _sampling(kind, False))
    assert free.outputs != constrained.outputs
    fast = _serve(tiny_llama_dir, model, backend, _sampling(kind, False), SpeculativeConfig(num_speculative_tokens=K),
                  OracleProposer(_prompts(), free.outputs, K))
    assert fast.outputs == constrained.outputs
    assert fast.sched.spec.counters.num_draft_tokens > fast.sched.spec.counters.num_accepted_tokens


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_a_draft_s_unconstrained_proposals_are_verified_under_the_grammar(tiny_llama_dir, model, backend, seeded):
    """The target drafting for itself without the grammar: its proposals are the free continuation,
    and sampled rows take the p/q rule with p the target's masked distribution. Greedy outputs equal
    decoding without speculation; seeded ones stay within the grammar (the same tokens as plain
    decoding are not promised there: the draft draws from its own streams)."""
    sampling = _sampling("regex", seeded)
    plain = _serve(tiny_llama_dir, model, backend, sampling)
    runner = with_draft(make_runner(tiny_llama_dir, model=model, num_blocks=64), model)
    runner.grammar = backend
    fast = serve(runner, RequestParams(max_tokens=40, sampling=sampling),
                 SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=K), _prompts(),
                 eos_token_ids=(EOS,))
    assert any(p.draft_proposals for p in fast.plans)
    if not seeded:
        assert fast.outputs == plain.outputs
    pattern = re.compile(SPECS["regex"].spec)
    for rid, (toks,) in fast.outputs.items():
        assert toks[-1] == EOS, rid
        assert pattern.fullmatch(_tokenizer(tiny_llama_dir).decode(toks[:-1])), rid


class _Repeat:
    """Proposes ``k`` copies of one token, whatever came before."""

    def __init__(self, token: int, k: int = K) -> None:
        self.token, self.k = token, k

    def propose(self, tokens: list[int], k: int) -> list[int]:
        return [self.token] * k


def test_a_grammar_that_dead_ends_after_a_proposal_is_the_requests_fault_as_without_speculation(
        tiny_llama_dir, model, backend):
    """After "aa" this grammar allows no token (and "a" is the only token "a" starts in this
    vocabulary). The first "a" comes from the prefill; verifying the proposals "a", "a", ... reaches
    the dead end midway through the walk, which stops there (it sampled that position unmasked, and
    the sequence then failed as the executor's fault, "does not match its grammar"), so the next
    step finds the dead end and rejects the request as invalid, as decoding without speculation does."""
    from executor_svc.grammar import NO_TOKEN_ALLOWED
    from pagedserve.engine_api import ErrorKind
    from pagedserve.wire import STRUCTURED_GRAMMAR, Structured

    a = _tokenizer(tiny_llama_dir).token_to_id("a")
    sampling = SamplingParams(temperature=0.0, end_token_ids=[EOS],
                              structured=Structured(STRUCTURED_GRAMMAR, 'root ::= "aa" stuck\nstuck ::= stuck'))
    runs = [_serve_allowing_errors(tiny_llama_dir, model, backend, sampling),
            _serve_allowing_errors(tiny_llama_dir, model, backend, sampling, SpeculativeConfig(num_speculative_tokens=K),
                                   _Repeat(a))]
    for run in runs:
        assert set(run.errors) == set(_prompts())
        assert all(kind == ErrorKind.INVALID and NO_TOKEN_ALLOWED in msg for kind, msg in run.errors.values()), run.errors
        assert all(out == [[a, a]] for out in run.outputs.values()), run.outputs
    assert runs[1].sched.spec.counters.num_draft_tokens > 0  # (the proposals were verified)


def _serve_allowing_errors(tiny_llama_dir, model, backend, sampling, spec=None, proposer=None):
    runner = make_runner(tiny_llama_dir, model=model, num_blocks=64)
    runner.grammar = backend
    return serve(runner, RequestParams(max_tokens=40, sampling=sampling), spec, _prompts(), proposer=proposer,
                 eos_token_ids=(EOS,), allow_errors=True)
