"""Prompt log-probs: the executor scores a prompt while prefilling it, only for requests that ask;
the scores equal transformers' log-softmax of the prompt's logits, through chunked prefill, a
prefix-cache hit (the scheduler takes none for such a prompt; an executor given one runs those
positions again, their K/V not written), n > 1, and a request
registered again after preemption (scored again from token 1, delivered once)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_svc.model import load_model
from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.wire import SamplingParams
from pagedserve.wire.codec import encode
from scheduler_svc.front.output.deltas import RequestStream
from scheduler_svc.sched import admission
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing.executor_plans import hf_logits, make_runner

PROMPT = [(7 * j + 3) % 480 + 5 for j in range(45)]


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return torch.log_softmax(hf_logits(hf, PROMPT), dim=-1)  # [P, vocab]


def _scheduler(runner, **cfg) -> Scheduler:
    return Scheduler(SchedulerConfig(**{"block_size": 16, "max_model_len": 256, **cfg}), runner.kv.num_blocks,
                     runner.kv.num_cpu_blocks, eos_token_ids=())


def _drive(sched: Scheduler, runner, reqs: list[GenerationRequest]) -> tuple[dict[str, list], dict[str, list]]:
    """Run ``reqs`` to the end: (prompt-score pieces, updates) per request; every result fits the
    bound its plan was sent with, and the scheduler's invariants hold after every step."""
    pieces: dict[str, list] = {r.request_id: [] for r in reqs}
    outputs: dict[str, list] = {r.request_id: [] for r in reqs}
    for r in reqs:
        sched.add_request(r)
    while sched.has_work():
        plan = sched.schedule()
        if plan is None:
            continue
        result = runner.execute(plan)
        assert result.error is None, result.error
        assert len(encode(result)) <= sched.in_flight[0].max_result_bytes()  # the scores fit the plan's bound
        for u in sched.update(result):
            if u.prompt_logprobs is not None:
                pieces[u.request_id].append(u.prompt_logprobs)
            outputs[u.request_id].append(u)
        sched.check_integrity()
    return pieces, outputs


def _serve(runner, reqs: list[GenerationRequest], **cfg) -> tuple[dict[str, list], Scheduler, dict[str, list]]:
    sched = _scheduler(runner, **cfg)
    pieces, outputs = _drive(sched, runner, reqs)
    return pieces, sched, outputs


def _warm(sched: Scheduler, runner) -> None:
    """A plain request caches PROMPT's blocks."""
    _drive(sched, runner, [GenerationRequest("warm", list(PROMPT), RequestParams(
        max_tokens=4, sampling=SamplingParams(temperature=0.0), ignore_eos=True))])


def _request(rid: str, k: int | None = 3, n: int = 1) -> GenerationRequest:
    sp = SamplingParams(temperature=0.0, prompt_logprobs=-1 if k is None else k, seed=1)
    return GenerationRequest(rid, list(PROMPT), RequestParams(max_tokens=4, sampling=sp, n=n, ignore_eos=True))


def _check(pieces, reference, k: int = 3) -> None:
    scores = [lp for piece in pieces for lp in piece.logprobs]
    assert [p.start for p in pieces] == [1 + sum(len(q.logprobs) for q in pieces[:i]) for i in range(len(pieces))]
    assert [s.token_id for s in scores] == PROMPT[1:]
    expected = reference[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])]
    assert [s.logprob for s in scores] == pytest.approx(expected.tolist(), abs=1e-4)
    # Each token's rank over the whole vocabulary: 1 + the tokens transformers finds more likely,
    # up to those within the two models' rounding of its log-prob.
    surely_above = (reference[:-1] > expected[:, None] + 1e-4).sum(dim=-1) + 1
    maybe_above = (reference[:-1] > expected[:, None] - 1e-4).sum(dim=-1) + 1
    for s, low, high in zip(scores, surely_above.tolist(), maybe_above.tolist(), strict=True):
        assert low <= s.rank <= high
    assert max(s.rank for s in scores) > k  # (random weights: the prompt holds tokens far below the top k)
    top = torch.topk(reference[:-1], k, dim=-1)
    assert [s.top_token_ids for s in scores] == top.indices.tolist()
    assert [v for s in scores for v in s.top_logprobs] == pytest.approx(top.values.flatten().tolist(), abs=1e-4)


@pytest.mark.parametrize("budget", [2048, 16])  # one step; chunks of 16 tokens
def test_prompt_scores_equal_transformers_in_one_step_or_in_chunks(tiny_llama_dir, model, reference, budget):
    runner = make_runner(tiny_llama_dir, model=model)
    pieces, _, _ = _serve(runner, [_request("a"), _request("plain", None)], max_num_batched_tokens=budget)
    _check(pieces["a"], reference)
    assert len(pieces["a"]) == (1 if budget == 2048 else 3) and pieces["plain"] == []  # only those that ask


def _warm_then_scored(runner) -> tuple[Scheduler, list, int]:
    """A plain request caches PROMPT's blocks; then a request scoring the same prompt runs."""
    sched = _scheduler(runner)
    _warm(sched, runner)
    hits_before = sched.prefix_cache_hit_tokens
    pieces, _ = _drive(sched, runner, [_request("scored")])
    return sched, pieces["scored"], sched.prefix_cache_hit_tokens - hits_before


def test_a_scored_prompt_takes_no_prefix_hit(tiny_llama_dir, model, reference):
    """The scheduler computes a scored prompt whole (the executor would otherwise run the hit's
    positions again, beyond the step's token budget and its result bound)."""
    runner = make_runner(tiny_llama_dir, model=model)
    _, pieces, hit_tokens = _warm_then_scored(runner)
    assert hit_tokens == 0
    _check(pieces, reference)


def test_a_prefix_hit_runs_the_cached_positions_again_without_rewriting_them(tiny_llama_dir, model, reference,
                                                                            monkeypatch):
    """The executor's side of the contract: a scored sequence registered with computed tokens (a
    scheduler that takes the hit) has those positions run again, their K/V not written."""
    monkeypatch.setattr(admission, "takes_prefix_hits", lambda req: True)
    runner = make_runner(tiny_llama_dir, model=model)
    sched = _scheduler(runner)
    _warm(sched, runner)
    before = [layer[0].clone() for layer in runner.kv.layers]
    pieces = _drive(sched, runner, [_request("hit")])[0]["hit"]
    assert sched.prefix_cache_hit_tokens >= 32
    _check(pieces, reference)
    for old, layer in zip(before, runner.kv.layers, strict=True):  # the hit blocks' K/V were not written again
        assert torch.equal(old[:2], layer[0][:2])


def test_n_choices_are_scored_once(tiny_llama_dir, model, reference):
    runner = make_runner(tiny_llama_dir, model=model)
    pieces, _, _ = _serve(runner, [_request("n", n=3)])
    _check(pieces["n"], reference)


def _request_long(rid: str) -> GenerationRequest:
    sp = SamplingParams(temperature=0.0, prompt_logprobs=3)
    return GenerationRequest(rid, list(PROMPT), RequestParams(max_tokens=40, sampling=sp, ignore_eos=True))


def test_preempted_requests_hand_their_prompt_scores_to_the_client_once(tiny_llama_dir, model, reference):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    runner = make_runner(tiny_llama_dir, model=model, num_blocks=8, num_cpu_blocks=0)
    reqs = [_request_long(f"r{i}") for i in range(3)]
    _, sched, outputs = _serve(runner, reqs, max_num_batched_tokens=32, max_num_seqs=4)
    assert sched.num_preemptions > 0
    expected = reference[torch.arange(len(PROMPT) - 1), torch.tensor(PROMPT[1:])].tolist()
    for r in reqs:
        stream = RequestStream(r, tok, 1)
        delivered = [out.prompt_logprobs for u in outputs[r.request_id] for out in [stream.apply(u)[0]]
                     if out.prompt_logprobs is not None]
        assert len(delivered) == 1 and delivered[0][0] is None
        assert [s.logprob for s in delivered[0][1:]] == pytest.approx(expected, abs=1e-4)


def test_a_prompt_scored_again_from_token_1_replaces_the_first_pass(tiny_llama_dir):
    from tokenizers import Tokenizer

    from pagedserve.engine_api import PromptScores, RequestUpdate, SeqUpdate, TokenLogprob

    stream = RequestStream(_request("x"), Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json")), 1)
    lp = [TokenLogprob(t, -1.0 * t) for t in PROMPT[1:]]
    for start, piece in ((1, lp[:10]), (1, lp[:20]), (21, lp[20:])):  # registered again after 10 tokens
        stream.apply(RequestUpdate("x", [], False, len(PROMPT), prompt_logprobs=PromptScores(start, piece)))
    assert stream.prompt_scores == lp
    out, _ = stream.apply(RequestUpdate("x", [SeqUpdate(0, [40])], False, len(PROMPT)))
    assert out.prompt_logprobs == [None, *lp] and stream.prompt_scores_sent


@pytest.mark.parametrize("budget", [2048, 128])  # one step; chunks (the running path)
def test_the_plan_bound_counts_the_scores_its_chunks_may_carry(tiny_llama_dir, model, budget):
    """200 prompt tokens at 20 alternatives each: about 58 KB of scores, far past what a plan without
    them may be answered with. ``_serve`` checks every result against its plan's bound."""
    runner = make_runner(tiny_llama_dir, model=model)
    prompt = [(11 * j + 5) % 480 + 5 for j in range(200)]
    sp = SamplingParams(temperature=0.0, prompt_logprobs=20)
    req = GenerationRequest("long", prompt, RequestParams(max_tokens=2, sampling=sp, ignore_eos=True))
    pieces, _, _ = _serve(runner, [req], max_num_batched_tokens=budget)
    assert sum(len(p.logprobs) for p in pieces["long"]) == len(prompt) - 1
