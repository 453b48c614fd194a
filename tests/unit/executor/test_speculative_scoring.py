"""Verification in one forward through the paged attention kernels: greedy speculative decoding
emits exactly transformers' greedy tokens, whatever the proposals, for every family and k."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_svc.batch import SeqState, build_batch
from executor_svc.model import load_model
from executor_svc.speculative.score import accept_greedy, score_proposals
from pagedserve.wire import SamplingParams
from scheduler_svc.sched.speculation import NgramProposer, SpeculativeConfig
from testing.executor_plans import hf_greedy, make_runner

BLOCK = 16
NEW = 24


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def setup(request, tiny_checkpoint):
    path = tiny_checkpoint(request.param, "small")
    model = load_model(path)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return path, model, hf


def _seq(sid: int, prompt: list[int], blocks: list[int]) -> SeqState:
    return SeqState(sid, list(prompt), len(prompt), blocks, 0, SamplingParams(temperature=0.0))


def _prefill(runner, s: SeqState) -> None:
    n = len(s.token_ids) - 1
    if n:
        b = build_batch({s.seq_id: s}, BLOCK, runner.model.device, [s.seq_id], [n])
        with torch.inference_mode():
            runner.model.forward(torch.tensor(b.token_ids), b.positions, runner.kv.layers, b.meta, runner.backend)
        s.num_computed_tokens = n


def _prompts(rng: random.Random) -> list[list[int]]:
    phrase = [rng.randrange(3, 400) for _ in range(7)]
    return [[rng.randrange(3, 400) for _ in range(n)] for n in (1, 5, 17, 40)] + [phrase * 5]


@pytest.mark.parametrize("k", [1, 3, 7])
def test_speculative_greedy_equals_plain_greedy(setup, k):
    path, model, hf = setup
    runner = make_runner(path, num_blocks=64, block_size=BLOCK, model=model)
    rng = random.Random(k)
    prompts = _prompts(rng)
    want = [hf_greedy(hf, p, NEW) for p in prompts]
    ngram = NgramProposer(SpeculativeConfig("ngram", k, 3, 1))
    seqs = [_seq(i, p, list(range(i * 8, i * 8 + 8))) for i, p in enumerate(prompts)]
    for s in seqs:
        _prefill(runner, s)
    steps = accepted = 0
    while any(len(s.token_ids) - s.num_prompt_tokens < NEW for s in seqs):
        live = [s for s in seqs if len(s.token_ids) - s.num_prompt_tokens < NEW]
        props = []
        for s in live:  # the truth for a random length then garbage, or what the n-gram proposer finds
            out = len(s.token_ids) - s.num_prompt_tokens
            truth = want[s.seq_id][out:out + k]
            good = rng.randint(0, len(truth))
            props.append(truth[:good] + [(t + 1) % 400 for t in truth[good:]] if rng.random() < 0.7
                         else ngram.propose(s.token_ids))
        for s, p, logits in zip(live, props, score_proposals(model, runner.kv, runner.backend, live, props), strict=True):
            accepted += len(accept_greedy(s, p, logits)) - 1
        steps += 1
    for s, w in zip(seqs, want, strict=True):
        assert s.token_ids[s.num_prompt_tokens:s.num_prompt_tokens + NEW] == w
    assert accepted > 0 and steps < NEW  # proposals were accepted: fewer forwards than tokens


def test_scoring_refuses_unreserved_blocks(setup):
    path, model, _ = setup
    runner = make_runner(path, num_blocks=8, block_size=BLOCK, model=model)
    s = _seq(0, list(range(3, 18)), [0])  # 15 tokens in one block: room for 1 more, not 2
    _prefill(runner, s)
    with pytest.raises(ValueError, match="blocks for 2 proposals"):
        score_proposals(model, runner.kv, runner.backend, [s], [[5, 6]])


def _hist(tokens: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double()


SAMPLED = SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.3, presence_penalty=0.5,
                         seed=11)


def test_target_probs_row_i_is_the_sampler_law_after_the_first_i_proposals(setup):
    """Row i must equal the distribution the plain sampler draws from for the sequence with
    proposals[:i] appended: checked by drawing many seeded tokens from the real Sampler."""
    from executor_svc.sampler import Sampler
    from executor_svc.speculative.target_probs import target_probs

    path, model, _ = setup
    runner = make_runner(path, num_blocks=16, block_size=BLOCK, model=model)
    prompt, props = [5, 9, 33, 9, 12, 40, 7], [9, 21, 5]
    s = SeqState(0, list(prompt), len(prompt), list(range(8)), 0, SAMPLED)
    _prefill(runner, s)
    logits = score_proposals(model, runner.kv, runner.backend, [s], [props])[0]
    probs = target_probs(s, props, logits)
    vocab = logits.shape[1]
    for i in (0, 2):
        view = SeqState(0, prompt + props[:i], len(prompt), [], 0, SAMPLED)
        n, draws = 3000, []
        sampler = Sampler(seed=i)
        for seed in range(n):
            view.sampling = msgspec.structs.replace(SAMPLED, seed=seed)
            draws.append(sampler.sample(logits[i:i + 1].clone(), [view]).token_ids[0])
        seen = _hist(draws, vocab)
        assert set(torch.nonzero(seen).flatten().tolist()) <= set(torch.nonzero(probs[i]).flatten().tolist())
        assert float((seen / n - probs[i].double()).abs().max()) < 0.04


def test_sampled_speculation_is_reproducible_with_a_seed(setup):
    from executor_svc.speculative.target_probs import accept_sampled

    path, model, _ = setup
    runs = []
    for _ in range(2):
        runner = make_runner(path, num_blocks=16, block_size=BLOCK, model=model)
        s = SeqState(0, [5, 9, 33, 9, 12, 40, 7, 9, 33], 9, list(range(8)), 0, SAMPLED)
        _prefill(runner, s)
        ngram = NgramProposer(SpeculativeConfig("ngram", 4, 2, 1))
        while len(s.token_ids) < 9 + 20:
            props = ngram.propose(s.token_ids)
            logits = score_proposals(model, runner.kv, runner.backend, [s], [props])[0]
            accept_sampled(s, props, logits)
        runs.append(s.token_ids[9:29])
    assert runs[0] == runs[1]
