"""Parallel sampling (n > 1) and beam search through the scheduler.

Parallel sampling must prefill the prompt once, fork it n ways (copy-on-write
on the shared partial block) and give choice i the seed ``seed + i``. Beam
search must return exactly what Hugging Face transformers' beam search returns
for the same model — a tiny torch "model" whose logits are the fake
executor's — including under preemption by recompute and by swap.
"""

from __future__ import annotations

import random

import pytest
import torch
from transformers import GenerationMixin, PretrainedConfig, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutput

from pagedserve.engine_api import FinishReason, GenerationRequest, RequestParams
from pagedserve.wire import SamplingParams
from scheduler_svc.sched.request import MigratedRequest
from testing import fake_executor
from testing.fake_executor import drive, model_logprobs
from tests.unit.sched.test_scheduler import BS, EOS, VOCAB, assert_all_released, make, oracle


@pytest.fixture(autouse=True, params=[1, 2], ids=["sync", "async"])
def plan_depth(request, monkeypatch):
    """Every scenario runs twice: plan, run, update (sync), and with the next plan built
    while one is in flight (async scheduling); outputs must be the same."""
    monkeypatch.setattr(fake_executor, "DEFAULT_DEPTH", request.param)
    return request.param



def nreq(rid: str, prompt: list[int], n: int, max_tokens: int = 10, seed: int = 100, **kw):
    return GenerationRequest(rid, prompt, RequestParams(max_tokens=max_tokens, sampling=SamplingParams(seed=seed),
                                                        n=n, **kw))


# --------------------------------------------------------------------------- parallel sampling


def test_prompt_is_prefilled_once_then_forked_with_copy_on_write():
    sched, ex = make(64)
    r = nreq("p", list(range(10, 20)), n=3, max_tokens=6, ignore_eos=True)  # 10 tokens: 9 % 4 != 0
    sched.add_request(r)
    first = sched.schedule()
    assert first.scheduled_seq_ids == [first.new_seqs[0].seq_id] and first.num_new_tokens == [9]
    sched.update(ex.run(first))
    second = sched.schedule()
    parent = first.new_seqs[0].seq_id
    assert [(f.parent_seq_id, f.seed) for f in second.forks] == [(parent, 101), (parent, 102)]
    assert second.num_new_tokens == [1, 1, 1]
    assert len(second.copies) == 2  # two writers copy the shared partial block, the last writes in place
    assert sched.block_stats()["shared"] >= 2  # the two full prompt blocks
    firsts = {su.index: su.new_token_ids for u in sched.update(ex.run(second)) for su in u.seqs}
    outs = drive(sched, ex)
    assert ex.tokens_computed == 9 + 3 * 6  # the prompt once, then one token per choice per step
    for i in range(3):
        assert firsts[i] + outs[("p", i)] == oracle(r, i)
    assert_all_released(sched, ex)


def _collect(sched, ex):
    outs, reasons, finished = {}, {}, []

    def watch(_, ups):
        for u in ups:
            for su in u.seqs:
                if su.finish_reason is not None:
                    reasons[(u.request_id, su.index)] = su.finish_reason
            if u.finished:
                finished.append(u.request_id)

    outs = drive(sched, ex, on_step=watch)
    return outs, reasons, finished


@pytest.mark.parametrize("nblocks,ncpu,mode", [(200, 0, "recompute"), (32, 0, "recompute"), (32, 64, "swap")])
def test_parallel_sampling_outputs_match_each_choice_alone(nblocks, ncpu, mode):
    reqs = [nreq(f"r{i}", [i + 5] * (1 + 3 * (i % 6)), n=1 + i % 3, max_tokens=12 + i, seed=10 * i)
            for i in range(10)]
    sched, ex = make(nblocks, ncpu, mode)
    for r in reqs:
        sched.add_request(r)
    outs, reasons, finished = _collect(sched, ex)
    if nblocks < 100:
        assert sched.num_preemptions > 0
    for r in reqs:
        for i in range(r.params.n):
            assert outs[(r.request_id, i)] == oracle(r, i), (r.request_id, i)
            assert reasons[(r.request_id, i)] in (FinishReason.EOS, FinishReason.LENGTH)
    assert sorted(finished) == sorted(r.request_id for r in reqs)  # once each
    assert_all_released(sched, ex)


def test_prefix_hit_up_to_the_last_token_forks_at_admission():
    sched, ex = make(64)
    prompt = list(range(30, 39))  # 9 tokens: the first 8 are two full blocks
    sched.add_request(nreq("a", prompt, n=1, max_tokens=1))
    drive(sched, ex)
    r = nreq("b", prompt, n=2, max_tokens=3, ignore_eos=True)
    sched.add_request(r)
    plan = sched.schedule()
    assert len(plan.new_seqs) == 1 and plan.new_seqs[0].num_computed_tokens == 8
    assert len(plan.forks) == 1 and plan.num_new_tokens == [1, 1]
    firsts = {su.index: su.new_token_ids for u in sched.update(ex.run(plan)) for su in u.seqs}
    outs = drive(sched, ex)
    assert all(firsts[i] + outs[("b", i)] == oracle(r, i) for i in range(2))
    assert_all_released(sched, ex)


def test_one_token_prompt_forks_immediately_and_choices_stop_separately():
    sched, ex = make(64)
    r = nreq("one", [9], n=4, max_tokens=5)
    sched.add_request(r)
    plan = sched.schedule()
    assert len(plan.new_seqs) == 1 and len(plan.forks) == 3 and plan.num_new_tokens == [1] * 4
    firsts = {su.index: su.new_token_ids for u in sched.update(ex.run(plan)) for su in u.seqs}
    outs = drive(sched, ex)
    assert all(firsts[i] + outs.get(("one", i), []) == oracle(r, i) for i in range(4))
    assert_all_released(sched, ex)


def test_finish_sequence_ends_one_choice_only():
    sched, ex = make(64)
    sched.add_request(nreq("s", [1, 2, 3, 4, 5], n=2, max_tokens=20, ignore_eos=True))
    for _ in range(4):
        sched.update(ex.run(sched.schedule()))
    assert sched.finish_sequence("s", 0, FinishReason.STOP) is False
    assert len(sched.requests["s"].live) == 1
    drive(sched, ex)
    assert_all_released(sched, ex)


# --------------------------------------------------------------------------- beam search vs HF


class _Cfg(PretrainedConfig):
    model_type = "pagedserve-fake-beam"


class _FakeLM(PreTrainedModel, GenerationMixin):
    """The fake executor's model as a transformers model (no cache: full recompute)."""

    config_class = _Cfg

    def __init__(self, cfg: _Cfg) -> None:
        super().__init__(cfg)
        self.unused = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids=None, attention_mask=None, **kw):
        rows = torch.tensor([model_logprobs(s, VOCAB) for s in input_ids.tolist()], dtype=torch.float64)
        return CausalLMOutput(logits=rows[:, None, :].expand(-1, input_ids.shape[1], -1))

    def prepare_inputs_for_generation(self, input_ids, **kw):
        return {"input_ids": input_ids}


_HF = None


def hf_beams(prompt: list[int], width: int, max_tokens: int, length_penalty: float,
             early_stopping: bool) -> list[list[int]]:
    global _HF
    if _HF is None:
        _HF = _FakeLM(_Cfg(vocab_size=VOCAB)).eval()
    out = _HF.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width,
                       max_new_tokens=max_tokens, do_sample=False, early_stopping=early_stopping,
                       length_penalty=length_penalty, eos_token_id=EOS, pad_token_id=0, use_cache=False)
    res = []
    for row in out.tolist():
        gen = row[len(prompt):]
        res.append(gen[: gen.index(EOS) + 1] if EOS in gen else gen)
    return res


CASES = [  # prompt, width, max_tokens, length_penalty, early_stopping
    ([5, 6, 7], 3, 6, 1.0, False),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9], 2, 9, 1.0, False),
    ([11] * 6, 4, 8, 2.0, False),
    ([12, 40, 41], 3, 10, 0.0, False),
    ([13, 2, 50, 51, 52], 4, 7, -0.5, False),
    ([14, 9], 3, 9, 1.0, True),
    ([15, 16, 17, 18], 2, 12, 1.0, False),
    ([19, 20], 3, 16, 1.0, False),
    ([21, 22, 23], 4, 16, 0.5, False),
    ([24], 2, 16, 1.0, True),
    ([25, 26, 27, 28, 29], 3, 14, 3.0, False),
]


@pytest.mark.parametrize("case", CASES)
def test_beam_search_matches_transformers(case):
    prompt, width, max_tokens, lp, early = case
    expected = hf_beams(prompt, width, max_tokens, lp, early)
    sched, ex = make(128)
    sched.add_request(GenerationRequest("b", prompt, RequestParams(
        max_tokens=max_tokens, beam_width=width, length_penalty=lp, early_stopping=early)))
    outs = drive(sched, ex)
    assert [outs[("b", i)] for i in range(width)] == expected
    assert_all_released(sched, ex)


@pytest.mark.parametrize("ncpu,mode", [(0, "recompute"), (64, "swap")])
def test_beam_search_survives_preemption(ncpu, mode):
    reqs, expected = [], {}
    for k, (prompt, width, max_tokens, lp, early) in enumerate(CASES):
        rid = f"b{k}"
        reqs.append(GenerationRequest(rid, prompt, RequestParams(
            max_tokens=max_tokens, beam_width=width, length_penalty=lp, early_stopping=early)))
        expected[rid] = hf_beams(prompt, width, max_tokens, lp, early)
    sched, ex = make(20, ncpu, mode, seqs=16)
    for r in reqs:
        sched.add_request(r)
    copies = []
    outs = drive(sched, ex, on_step=lambda plan, _: copies.extend(plan.copies))
    assert sched.num_preemptions > 0 and copies  # beams shared partial blocks and copied on write
    for r in reqs:
        assert [outs[(r.request_id, i)] for i in range(r.params.beam_width)] == expected[r.request_id]
    assert_all_released(sched, ex)


def test_pruned_beams_free_their_blocks_immediately():
    sched, ex = make(128)
    sched.add_request(GenerationRequest("b", [5] * (BS * 3 + 1), RequestParams(max_tokens=12, beam_width=4)))
    freed_mid_search = 0
    while sched.has_work():
        plan = sched.schedule()
        if "b" in sched.requests and plan.free_seq_ids:
            freed_mid_search += len(plan.free_seq_ids)
        sched.update(ex.run(plan))
        sched.check_integrity()
        if "b" in sched.requests:
            live = sched.requests["b"].live
            assert len(live) <= 4
            assert sched.block_stats()["used"] <= 4 + 4 * 4  # shared prompt + per-beam tails
    assert freed_mid_search > 0
    assert_all_released(sched, ex)


def test_resumed_choices_prefill_in_chunks_and_sample_together():
    sched, ex = make(200, tokens=16)
    r = nreq("m", list(range(20, 60)), n=3, max_tokens=6, ignore_eos=True)
    done = [oracle(r, i)[:2] for i in range(3)]
    sched.add_request(r, resume=MigratedRequest(r, done, [None, None, None]))
    sampled_steps = []
    outs = drive(sched, ex, on_step=lambda plan, ups: sampled_steps.append(
        sum(len(su.new_token_ids) for u in ups for su in u.seqs)))
    assert sampled_steps[: 126 // 16].count(0) >= 7  # 3 x 42 tokens in chunks of at most 16
    first = next(n for n in sampled_steps if n)
    assert first == 3  # all choices reach their last token in the same step
    for i in range(3):
        assert done[i] + outs[("m", i)] == oracle(r, i)
    assert_all_released(sched, ex)


def test_group_wider_than_the_budgets_is_rejected():
    sched, _ = make(200, seqs=2)
    with pytest.raises(ValueError, match="max_num_seqs"):
        sched.add_request(nreq("w", [1, 2], n=3))
    with pytest.raises(ValueError, match="max_num_seqs"):
        sched.add_request(GenerationRequest("b", [1, 2], RequestParams(max_tokens=3, beam_width=3)))


def _mixed_workload(seed: int) -> list[GenerationRequest]:
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB) for _ in range(12)]
    reqs = []
    for i in range(14):
        prompt = base[: rng.randint(0, 12)] + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 14))]
        kind = rng.random()
        if kind < 0.25:
            params = RequestParams(max_tokens=rng.randint(2, 8), beam_width=rng.randint(2, 3),
                                   length_penalty=rng.choice([0.0, 1.0, 2.0]))
        else:
            params = RequestParams(max_tokens=rng.randint(1, 14), n=rng.choice([1, 1, 2, 3]),
                                   sampling=SamplingParams(seed=rng.randrange(1000)),
                                   stop_token_ids=[rng.randrange(VOCAB)] if kind > 0.9 else [])
        reqs.append(GenerationRequest(f"r{i}", prompt, params))
    return reqs


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("ncpu,mode", [(0, "recompute"), (48, "swap")])
def test_mixed_workload_with_aborts_matches_an_unconstrained_run(seed, ncpu, mode):
    """n > 1, beams, stop ids, shared prefixes and aborts on a tiny pool, vs a huge pool."""
    reqs = _mixed_workload(seed)
    big, ex_big = make(600, seqs=32, tokens=64)
    for r in reqs:
        big.add_request(r)
    want = drive(big, ex_big)
    sched, ex = make(30, ncpu, mode, seqs=16, tokens=24)
    for r in reqs:
        sched.add_request(r)
    rng = random.Random(seed + 100)
    aborted = {rng.choice(reqs).request_id for _ in range(2)}
    step = 0

    def maybe_abort(plan, ups):
        nonlocal step
        step += 1
        if step == 5 + seed:
            for rid in aborted:
                sched.abort_request(rid)

    got = drive(sched, ex, on_step=maybe_abort)
    assert sched.num_preemptions > 0 and big.num_preemptions == 0
    for key, toks in want.items():
        if key[0] not in aborted:
            assert got[key] == toks, key
    assert_all_released(sched, ex)
