"""A result that breaks the contract changes nothing: ``Scheduler.update`` checks all of it (samples,
LoRA failures, speculative tokens) before it takes the plan off the in-flight queue, so the engine
can drop that executor and migrate every request from the state before the result."""

from __future__ import annotations

import re

import pytest

from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.wire import LoraFailure, SamplingParams, SpecTokens, StepResult
from scheduler_svc.sched.in_flight import ProtocolError
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from scheduler_svc.sched.speculation import SpeculativeConfig

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # "8 5 6 7" follows "5 6 7": an n-gram proposer proposes


def _decoding(speculative: SpeculativeConfig | None):
    """A scheduler whose one sequence has prefilled and sampled 8; its decode plan is in flight."""
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                      speculative=speculative), 32, 0, (2,), vocab_size=100)
    sched.add_request(GenerationRequest("r", list(PROMPT), RequestParams(
        max_tokens=20, ignore_eos=True, sampling=SamplingParams(temperature=0.0))))
    prefill = sched.schedule()
    sched.update(StepResult(prefill.step_id, list(prefill.scheduled_seq_ids), [8]))
    plan = sched.schedule()
    sched.check_integrity()
    return sched, plan


def test_speculative_tokens_the_plan_did_not_ask_for_leave_the_plan_in_flight():
    sched, plan = _decoding(SpeculativeConfig(num_speculative_tokens=3))
    assert plan.proposals, "the n-gram proposer had a match: the decode plan proposes"
    sid = plan.scheduled_seq_ids[0]
    bad = StepResult(plan.step_id, [sid], [5], spec_tokens=[SpecTokens(sid + 1, [6])])
    with pytest.raises(ProtocolError, match="speculative tokens for seq"):
        sched.update(bad)
    assert [s.step_id for s in sched.in_flight] == [plan.step_id]  # nothing was applied
    sched.check_integrity()
    updates = sched.update(StepResult(plan.step_id, [sid], [5], spec_tokens=[SpecTokens(sid, [6, 7])]))
    assert updates[0].seqs[0].new_token_ids == [5, 6, 7]
    sched.check_integrity()


def test_speculative_tokens_without_speculation_break_the_contract():
    sched, plan = _decoding(None)
    assert not plan.proposals
    sid = plan.scheduled_seq_ids[0]
    with pytest.raises(ProtocolError, match="proposes none"):
        sched.update(StepResult(plan.step_id, [sid], [5], spec_tokens=[SpecTokens(sid, [6])]))
    assert [s.step_id for s in sched.in_flight] == [plan.step_id]
    assert sched.update(StepResult(plan.step_id, [sid], [5]))[0].seqs[0].new_token_ids == [5]
    sched.check_integrity()


@pytest.mark.parametrize("slots", [[7], [1], [0, 0]], ids=["no-such-slot", "a-slot-the-plan-did-not-load", "twice"])
def test_lora_failures_for_slots_the_plan_did_not_load_break_the_contract(slots):
    """Only a load the plan asked for can fail: a failure naming another slot (one the executor does not
    even have, or one whose adapter serves requests) is the executor's fault, never those requests'."""
    cfg = SchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64, lora_slots=2)
    sched = Scheduler(cfg, 32, 0, (2,), vocab_size=100, lora_paths={"a0": "/adapters/a0"})
    sched.add_request(GenerationRequest("r", list(PROMPT), RequestParams(max_tokens=4, ignore_eos=True),
                                        lora="a0"))
    plan = sched.schedule()
    assert [x.slot for x in plan.lora_loads] == [0]
    sid = plan.scheduled_seq_ids[0]
    bad = StepResult(plan.step_id, [sid], [5], lora_failures=[LoraFailure(s, "no such file") for s in slots])
    with pytest.raises(ProtocolError, match=re.escape(f"LoRA load failures for slots {slots}; its plan loaded slots [0]")):
        sched.update(bad)
    assert [s.step_id for s in sched.in_flight] == [plan.step_id]  # nothing was applied
    sched.check_integrity()
    assert sched.update(StepResult(plan.step_id, [sid], [5]))[0].seqs[0].new_token_ids == [5]
    sched.check_integrity()
