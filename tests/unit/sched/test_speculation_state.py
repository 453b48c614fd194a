"""A sequence's speculation state lives as long as the sequence: however it ends (by length on a step
that did not speculate, aborted by its client, stopped by a stop string the front found), the
scheduler keeps nothing of it, so a long-running server's memory does not grow with every request
that ever speculated."""

from __future__ import annotations

import pytest

from pagedserve.engine_api import FinishReason, GenerationRequest, RequestParams
from pagedserve.wire import SamplingParams, StepResult
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from scheduler_svc.sched.speculation import SpeculativeConfig

PROMPT = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7]  # then 8: "5 6 7 8" occurred before, so "5 6 7" is proposed


def _step(sched: Scheduler, sample: int) -> bool:
    """One plan, ``sample`` the token of every sequence it samples (any proposal rejected); whether it
    carried proposals (False also when there was no plan). The scheduler's invariants must hold."""
    plan = sched.schedule()
    if plan is None:
        return False
    step = sched.in_flight[-1]
    sched.update(StepResult(plan.step_id, [s.seq_id for s in step.sampling], [sample] * len(step.sampling)))
    sched.check_integrity()
    return bool(plan.proposals)


def _speculated() -> Scheduler:
    """A scheduler whose one request has had proposals verified (and rejected) and goes on decoding."""
    sched = Scheduler(SchedulerConfig(block_size=4, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64,
                                      speculative=SpeculativeConfig(num_speculative_tokens=3)), 32, 0, (2,),
                      vocab_size=100)
    sched.add_request(GenerationRequest("r", list(PROMPT), RequestParams(
        max_tokens=8, ignore_eos=True, sampling=SamplingParams(temperature=0.0))))
    assert not _step(sched, 8)  # the prefill
    assert _step(sched, 20)  # proposals "5 6 7", rejected: 20 comes, found nowhere before
    assert len(sched.spec.policy) == 1 and len(sched.spec.mirror) == 1  # (its acceptance and tokens are kept)
    assert "r" in sched.requests
    return sched


@pytest.mark.parametrize("end", ["length", "abort", "stop string"])
def test_a_sequence_that_speculated_leaves_no_speculation_state(end):
    sched = _speculated()
    if end == "length":  # the steps after the proposals' find nothing to propose: it ends on a plain one
        fresh = 21
        while sched.has_work():
            assert not _step(sched, fresh)
            fresh += 1
    elif end == "abort":
        sched.abort_request("r")
    else:
        assert sched.finish_sequence("r", 0, FinishReason.STOP)
    assert not sched.requests
    sched.check_integrity()
    assert len(sched.spec.policy) == 0 and len(sched.spec.mirror) == 0
    assert not sched.spec.pending
