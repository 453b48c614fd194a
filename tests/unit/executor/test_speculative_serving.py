"""Speculative decoding served end to end: the real Scheduler proposing n-grams and the real
ModelRunner verifying them (no transport). Outputs must equal decoding without speculation token
for token (greedy and seeded sampling, with stops, max_tokens, penalties and log-probs), fewer
plans must be needed on repetitive text, the invariants must hold after every step and every
block must be free at the end."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_svc.model import load_model
from pagedserve.engine_api import RequestParams
from pagedserve.wire import SamplingParams
from scheduler_svc.sched.speculation import SpeculativeConfig
from testing.executor_plans import hf_greedy, make_runner
from testing.speculative_serving import OracleProposer, serve

NUM_BLOCKS = 48


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(5)
    phrase = torch.randint(3, 500, (7,), generator=g).tolist()
    return {"rep": phrase * 4 + phrase[:3],  # an edit-like prompt: the continuation repeats it
            "rand": torch.randint(3, 500, (19,), generator=g).tolist(),
            "short": phrase[:4] + phrase[:4] + phrase[:2]}


def _serve(tiny_llama_dir, model, params: RequestParams, spec: SpeculativeConfig | None,
           prompts: dict[str, list[int]], num_blocks: int = NUM_BLOCKS, max_batched: int = 256,
           mode: str = "recompute", proposer=None, verified: int = 256):
    runner = make_runner(tiny_llama_dir, num_blocks=num_blocks, num_cpu_blocks=32, model=model)
    s = serve(runner, params, spec, prompts, num_cpu_blocks=32, max_batched=max_batched, mode=mode,
              proposer=proposer, verified=verified)
    return s.outputs, s.plans, s.sched, s.logprobs


GREEDY = SamplingParams(temperature=0.0)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_output_equals_decoding_without_speculation_and_transformers(tiny_llama_dir, model, k):
    params = RequestParams(max_tokens=30, sampling=GREEDY, ignore_eos=True)
    spec = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=3, prompt_lookup_min=1)
    plain, plain_plans, _, _ = _serve(tiny_llama_dir, model, params, None, _prompts())
    stack, widths = model.decode_stack, []  # (the widest query of each step the fused C stack ran)

    def spy(x, positions, caches, meta, lora=None):
        widths.append(meta.max_query_len)
        return stack(x, positions, caches, meta, lora)

    model.decode_stack = spy
    try:
        fast, fast_plans, sched, _ = _serve(tiny_llama_dir, model, params, spec, _prompts())
    finally:
        model.decode_stack = stack
    assert fast == plain
    assert max(widths) > 1  # verifications ran in the one C call, their rows decode queries of their own
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    for rid, p in _prompts().items():
        assert fast[rid] == [hf_greedy(hf, p, 30)], rid
    assert any(plan.proposals for plan in fast_plans)
    assert sched.spec.counters.num_drafts > 0 and sched.spec.counters.num_draft_tokens >= sched.spec.counters.num_drafts
    assert sched.spec.counters.num_accepted_tokens == sum(sched.spec.counters.accepted_per_pos[:k])
    if sched.spec.counters.num_accepted_tokens:
        assert len(fast_plans) < len(plain_plans)  # accepted proposals save steps


@pytest.mark.parametrize("arch", ["qwen2", "mistral"])
def test_greedy_output_of_the_other_families_equals_decoding_without_speculation_and_transformers(tiny_checkpoint,
                                                                                                 arch):
    """qwen2 (biased q/k/v projections) and mistral, as llama above: the verification rows are decode
    rows of the fused stack, so the outputs are plain decoding's and transformers'."""
    path = tiny_checkpoint(arch, "small")
    family = load_model(path)
    params = RequestParams(max_tokens=24, sampling=GREEDY, ignore_eos=True)
    plain = _serve(path, family, params, None, _prompts())[0]
    fast, _, sched, _ = _serve(path, family, params, SpeculativeConfig(num_speculative_tokens=4), _prompts(),
                               proposer=OracleProposer(_prompts(), plain, 4))
    assert fast == plain
    assert sched.spec.counters.num_accepted_tokens > 0
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for rid, p in _prompts().items():
        assert fast[rid] == [hf_greedy(hf, p, 24)], rid


def test_a_step_verifies_at_most_its_budget_shared_in_scheduling_order(tiny_llama_dir, model):
    params = RequestParams(max_tokens=30, sampling=GREEDY, ignore_eos=True)
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
    plain, _, _, _ = _serve(tiny_llama_dir, model, params, None, _prompts())
    fast, plans, _, _ = _serve(tiny_llama_dir, model, params, spec, _prompts(), verified=6)
    assert fast == plain
    proposing = [p for p in plans if p.proposals]
    assert proposing
    for p in proposing:  # three decoding sequences leave room for 3 proposed tokens, not 3 x 4
        decoding = sum(1 for n in p.num_new_tokens if n == 1)
        assert decoding + sum(len(x.token_ids) for x in p.proposals) <= 6
    assert any(len(p.proposals) == 1 and len(p.proposals[0].token_ids) == 3 for p in proposing
               if len(p.scheduled_seq_ids) == 3)  # the first proposing sequence took the room


def test_seeded_sampling_with_penalties_and_logprobs_is_unchanged(tiny_llama_dir, model):
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=123, repetition_penalty=1.1,
                              presence_penalty=0.3, logprobs=2, want_logprobs=True)
    params = RequestParams(max_tokens=25, sampling=sampling, ignore_eos=True)
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
    plain, _, _, plain_lps = _serve(tiny_llama_dir, model, params, None, _prompts())
    fast, _, sched, fast_lps = _serve(tiny_llama_dir, model, params, spec, _prompts())
    assert fast == plain
    assert fast_lps["rep"] and [t for t, _ in fast_lps["rep"]] == [t for t, _ in plain_lps["rep"]] == fast["rep"][0]
    assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(fast_lps["rep"], plain_lps["rep"], strict=True))
    assert sched.spec.counters.num_drafts > 0


def test_no_token_past_max_tokens_or_a_stop_token(tiny_llama_dir, model):
    prompts = _prompts()
    plain, _, _, _ = _serve(tiny_llama_dir, model, RequestParams(max_tokens=30, sampling=GREEDY, ignore_eos=True),
                            None, {"rep": prompts["rep"]})
    stop_tok = plain["rep"][0][9]  # a token the greedy continuation emits at position 9
    spec = SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_max=3, prompt_lookup_min=1)
    for params in (RequestParams(max_tokens=5, sampling=GREEDY, ignore_eos=True),
                   RequestParams(max_tokens=30, sampling=GREEDY, ignore_eos=True, stop_token_ids=[stop_tok])):
        a, _, _, _ = _serve(tiny_llama_dir, model, params, None, {"rep": prompts["rep"]})
        b, _, _, _ = _serve(tiny_llama_dir, model, params, spec, {"rep": prompts["rep"]})
        assert b == a and len(b["rep"][0]) <= params.max_tokens
        if params.stop_token_ids:
            assert b["rep"][0][-1] == stop_tok and stop_tok not in b["rep"][0][:-1]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_speculation_keeps_outputs_and_frees_every_block(tiny_llama_dir, model, mode):
    params = RequestParams(max_tokens=24, sampling=GREEDY, ignore_eos=True)
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
    plain, _, _, _ = _serve(tiny_llama_dir, model, params, None, _prompts(), num_blocks=6, max_batched=48, mode=mode)
    fast, _, sched, _ = _serve(tiny_llama_dir, model, params, spec, _prompts(), num_blocks=6, max_batched=48,
                               mode=mode, proposer=OracleProposer(_prompts(), plain, 4))
    assert fast == plain
    assert sched.num_preemptions > 0 and sched.spec.counters.num_accepted_tokens > 0


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(temperature=1.0, top_p=0.9, seed=7, logprobs=1, want_logprobs=True)],
                         ids=["greedy", "seeded"])
def test_accepted_proposals_save_steps_and_change_nothing(tiny_llama_dir, model, sampling):
    """Proposals that are (mostly) right: runs of them are accepted, with the bonus token, or cut
    at the wrong one; the output is still exactly the plain one, in far fewer plans."""
    params = RequestParams(max_tokens=40, sampling=sampling, ignore_eos=True)
    plain, plain_plans, _, plain_lps = _serve(tiny_llama_dir, model, params, None, _prompts())
    spec = SpeculativeConfig(num_speculative_tokens=5)
    fast, fast_plans, sched, fast_lps = _serve(tiny_llama_dir, model, params, spec, _prompts(),
                                               proposer=OracleProposer(_prompts(), plain, 5))
    assert fast == plain
    if sampling.want_logprobs:  # the target's log-probs of the tokens emitted, speculated or not
        assert fast_lps["rand"] and [t for t, _ in fast_lps["rand"]] == [t for t, _ in plain_lps["rand"]]
        assert all(abs(a - b) < 1e-4 for (_, a), (_, b) in zip(fast_lps["rand"], plain_lps["rand"], strict=True))
    st = sched.spec.counters
    assert st.num_accepted_tokens > st.num_drafts  # several accepted per step on average
    assert st.accepted_per_pos[4] > 0 and st.num_accepted_tokens < st.num_draft_tokens  # whole runs, and cuts
    assert len(fast_plans) < 0.6 * len(plain_plans)
