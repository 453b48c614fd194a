"""A result that breaks the contract changes nothing: ``Scheduler.update`` checks all of it (samples,
LoRA failures, speculative tokens) before it takes the plan off the in-flight queue, so the engine
can drop that executor and migrate every request from the state before the result."""

from __future__ import annotations

import pytest

from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.wire import SamplingParams, SpecTokens, StepResult
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
