"""Speculative decoding with a draft model, end to end: the real Scheduler asking for draft
proposals and the real ModelRunner drafting them with a second model on its own paged pools, then
verifying. Greedy outputs must equal decoding without speculation (and transformers) token for
token, whether the draft is the target itself (everything accepted) or a random model (rejections);
seeded sampling must be reproducible; preemption (recompute and swap) must keep outputs; the
invariants must hold after every step and every block must be free at the end."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_svc.model import load_model
from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.wire import SamplingParams
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from scheduler_svc.sched.speculation import SpeculativeConfig
from testing.executor_plans import drive, hf_greedy, make_runner, with_draft
from testing.speculative_serving import serve

NUM_BLOCKS = 48
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def random_draft(tiny_checkpoint):
    """Same tokenizer and vocabulary, other weights and KV shape (one KV head): many rejections."""
    return load_model(tiny_checkpoint("llama", "small", seed=7, num_key_value_heads=1))


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(5)
    phrase = torch.randint(3, 500, (7,), generator=g).tolist()
    return {"rep": phrase * 4 + phrase[:3], "rand": torch.randint(3, 500, (19,), generator=g).tolist(),
            "long": torch.randint(3, 500, (40,), generator=g).tolist()}


def _serve(tiny_llama_dir, model, params: RequestParams, draft=None, k: int = 4, num_blocks: int = NUM_BLOCKS,
           max_batched: int = 256, mode: str = "recompute", prompts=None):
    runner = make_runner(tiny_llama_dir, num_blocks=num_blocks, num_cpu_blocks=32, model=model)
    spec = None
    if draft is not None:
        with_draft(runner, draft)
        spec = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=k)
    s = serve(runner, params, spec, prompts or _prompts(), num_cpu_blocks=32, max_batched=max_batched, mode=mode)
    assert not any(plan.proposals for plan in s.plans)  # the draft's proposals only
    return {rid: choices[0] for rid, choices in s.outputs.items()}, s.plans, s.sched, s.logprobs


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("which", ["self", "random"])
def test_greedy_output_equals_decoding_without_speculation_and_transformers(tiny_llama_dir, model, random_draft,
                                                                           k, which):
    params = RequestParams(max_tokens=30, sampling=GREEDY, ignore_eos=True)
    draft = model if which == "self" else random_draft
    plain, plain_plans, _, _ = _serve(tiny_llama_dir, model, params)
    fast, fast_plans, sched, _ = _serve(tiny_llama_dir, model, params, draft, k)
    assert fast == plain
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for rid, p in _prompts().items():
        assert fast[rid] == hf_greedy(hf, p, 30), rid
    st = sched.spec.counters
    assert any(plan.draft_proposals for plan in fast_plans) and st.num_draft_tokens > 0
    if which == "self":  # the target drafting for itself: every proposal accepted
        assert st.num_accepted_tokens == st.num_draft_tokens
        assert len(fast_plans) < 0.6 * len(plain_plans) or k == 1
    else:
        assert st.num_accepted_tokens < st.num_draft_tokens


def test_seeded_sampling_is_reproducible_and_logprobs_are_the_targets(tiny_llama_dir, model, random_draft):
    sampling = SamplingParams(temperature=0.9, top_k=50, seed=11, logprobs=2, want_logprobs=True,
                              presence_penalty=0.2)
    params = RequestParams(max_tokens=25, sampling=sampling, ignore_eos=True)
    a, _, sched, lps = _serve(tiny_llama_dir, model, params, random_draft, 3)
    b, _, _, _ = _serve(tiny_llama_dir, model, params, random_draft, 3)
    assert a == b
    assert sched.spec.counters.num_draft_tokens > 0
    assert all(len(v) == 25 for v in a.values())
    # Self-drafting accepts (almost) everything: p == q, so min(1, p/q) = 1.
    c, _, sched_self, _ = _serve(tiny_llama_dir, model, params, model, 3)
    st = sched_self.spec.counters
    assert st.num_accepted_tokens >= 0.9 * st.num_draft_tokens
    # Log-probs are the target's (raw mode: its log_softmax over the context), accepted proposals included.
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for rid, toks in a.items():
        assert [t for t, _ in lps[rid]] == toks
        prompt = _prompts()[rid]
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([prompt + toks])).logits[0].float(), dim=-1)
        want = [float(ref[len(prompt) - 1 + i, t]) for i, t in enumerate(toks)]
        assert max(abs(x - y) for (_, x), y in zip(lps[rid], want, strict=True)) < 1e-3, rid


@pytest.mark.parametrize("top_k", [0, 50])
@pytest.mark.parametrize("which", ["self", "random"])
def test_seeded_sampling_with_a_draft_equals_decoding_without_speculation(tiny_llama_dir, model, random_draft,
                                                                          which, top_k):
    """A seed promises the same tokens whatever else shares the steps: with a draft, the tokens of a
    seeded request must not depend on k (nor on how many proposals the budget leaves it in a busy
    batch), so they are those of decoding without speculation."""
    sampling = SamplingParams(temperature=0.9, top_k=top_k, seed=11, presence_penalty=0.2)
    params = RequestParams(max_tokens=25, sampling=sampling, ignore_eos=True)
    plain, _, _, _ = _serve(tiny_llama_dir, model, params)
    draft = model if which == "self" else random_draft
    for k in (1, 3):
        fast, _, sched, _ = _serve(tiny_llama_dir, model, params, draft, k)
        assert fast == plain, k
        st = sched.spec.counters
        assert st.num_draft_tokens > 0
        if which == "self":  # the draft draws with the target's uniform: nearly every proposal is kept
            assert st.num_accepted_tokens >= 0.9 * st.num_draft_tokens


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_a_draft_keeps_outputs_and_frees_every_block(tiny_llama_dir, model, random_draft, mode):
    params = RequestParams(max_tokens=24, sampling=GREEDY, ignore_eos=True)
    plain, _, _, _ = _serve(tiny_llama_dir, model, params, num_blocks=8, max_batched=48, mode=mode)
    for draft in (model, random_draft):
        fast, _, sched, _ = _serve(tiny_llama_dir, model, params, draft, 4, num_blocks=8, max_batched=48, mode=mode)
        assert fast == plain
        assert sched.num_preemptions > 0 and sched.spec.counters.num_draft_tokens > 0


def test_no_token_past_max_tokens_or_a_stop_token(tiny_llama_dir, model):
    prompts = {"rep": _prompts()["rep"]}
    plain, _, _, _ = _serve(tiny_llama_dir, model, RequestParams(max_tokens=30, sampling=GREEDY, ignore_eos=True),
                            prompts=prompts)
    stop_tok = plain["rep"][9]
    for params in (RequestParams(max_tokens=5, sampling=GREEDY, ignore_eos=True),
                   RequestParams(max_tokens=30, sampling=GREEDY, ignore_eos=True, stop_token_ids=[stop_tok])):
        a, _, _, _ = _serve(tiny_llama_dir, model, params, prompts=prompts)
        b, _, _, _ = _serve(tiny_llama_dir, model, params, model, 8, prompts=prompts)
        assert b == a and len(b["rep"]) <= params.max_tokens


def _sched(model, num_blocks: int = NUM_BLOCKS) -> Scheduler:
    spec = SpeculativeConfig(method="draft_model", model="draft", num_speculative_tokens=4)
    cfg = SchedulerConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=256, max_model_len=256,
                          speculative=spec)
    sched = Scheduler(cfg, num_blocks, 32, eos_token_ids=(), vocab_size=model.cfg.vocab_size)
    sched.spec.policy.max_verified_tokens = 256
    return sched


def test_a_failing_draft_fails_its_steps_requests_and_leaks_nothing(tiny_llama_dir, model, random_draft):
    """The draft runs in the step's launch: when it raises, the step's sequences fail (as for a
    failed forward), their blocks come back, and the runner serves the next requests."""
    runner = with_draft(make_runner(tiny_llama_dir, num_blocks=NUM_BLOCKS, num_cpu_blocks=32, model=model),
                        random_draft)
    sched = _sched(model)
    params = RequestParams(max_tokens=12, sampling=GREEDY, ignore_eos=True)
    real = runner.draft.propose
    calls = {"n": 0}

    def flaky(todo):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("draft exploded")
        real(todo)

    runner.draft.propose = flaky
    errors, done = [], {}
    for rid, p in _prompts().items():
        sched.add_request(GenerationRequest(rid, p, params))

    def take(plan, result):
        for upd in sched.update(result):
            if upd.error is not None:
                errors.append(upd.request_id)
            if upd.finished:
                done[upd.request_id] = upd.error is None
        sched.check_integrity()

    drive(runner, sched, take)
    assert set(errors) == set(done) == set(_prompts()) and not any(done.values())  # one batch: all failed
    assert sched.kv.num_free_blocks == NUM_BLOCKS and not sched.requests and not runner.seqs
    sched.add_request(GenerationRequest("after", _prompts()["rand"], params))
    out = []
    drive(runner, sched, lambda plan, result: [out.extend(s.new_token_ids) for u in sched.update(result)
                                               for s in u.seqs])
    assert len(out) == 12 and sched.kv.num_free_blocks == NUM_BLOCKS
    assert calls["n"] > 2  # the runner drafted again after the failure


def test_aborts_while_proposals_are_in_flight_leak_nothing(tiny_llama_dir, model, random_draft):
    runner = with_draft(make_runner(tiny_llama_dir, num_blocks=NUM_BLOCKS, num_cpu_blocks=32, model=model),
                        random_draft)
    sched = _sched(model)
    params = RequestParams(max_tokens=40, sampling=SamplingParams(temperature=0.8, seed=3), ignore_eos=True)
    for rid, p in _prompts().items():
        sched.add_request(GenerationRequest(rid, p, params))
    aborted = 0
    for _ in range(200):
        plan = sched.schedule()
        if plan is None:
            if not sched.has_work():
                break
            continue
        result = runner.execute(plan)
        if plan.draft_proposals and sched.requests:  # abort one request between the plan and its result
            sched.abort_request(sorted(sched.requests)[0])
            aborted += 1
        sched.update(result)
        sched.check_integrity()
    assert aborted == len(_prompts())
    assert not sched.requests and sched.kv.num_free_blocks == NUM_BLOCKS and not runner.seqs


def test_draft_proposals_to_an_executor_without_a_draft_are_refused(tiny_llama_dir, model):
    runner = make_runner(tiny_llama_dir, num_blocks=NUM_BLOCKS, num_cpu_blocks=32, model=model)
    sched = _sched(model)
    sched.add_request(GenerationRequest("a", _prompts()["rep"], RequestParams(max_tokens=8, sampling=GREEDY)))
    result = None
    for _ in range(5):
        plan = sched.schedule()
        result = runner.execute(plan)
        if plan.draft_proposals:
            break
        sched.update(result)
    assert result.refused and "holds no draft model (--speculative-model)" in result.error
