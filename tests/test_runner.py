"""ModelRunner: plan validation, state bookkeeping, seeded sampling through the model."""

from __future__ import annotations

import pytest
from executor_plans import PlanDriver, make_runner

from benchmarks.plan_driver import GREEDY
from executor_svc.model import load_model
from pagedserve.wire import BatchPlan, BlockUpdate, Fork, NewSeq, SamplingParams


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture
def runner(tiny_llama_dir, model):
    return make_runner(tiny_llama_dir, num_blocks=32, num_cpu_blocks=4, model=model)


def _new(sid: int, n: int = 5, blocks=(0,), computed: int = 0, sampling=GREEDY) -> NewSeq:
    return NewSeq(sid, list(range(10, 10 + n)), n, list(blocks), computed, sampling)


def _state(runner):
    return {sid: (list(s.token_ids), list(s.block_ids), s.num_computed_tokens) for sid, s in runner.seqs.items()}


@pytest.mark.parametrize("bad", [
    BatchPlan(1, [99], [1]),  # unknown scheduled seq
    BatchPlan(1, [1], [1], block_updates=[BlockUpdate(1, 1, [32])]),  # block id out of range
    BatchPlan(1, [1], [1], block_updates=[BlockUpdate(1, 5, [2])]),  # start beyond the table
    BatchPlan(1, [1], [10]),  # more new tokens than the sequence holds
    BatchPlan(1, [1, 1], [1, 1]),  # scheduled twice
    BatchPlan(1, [], [], new_seqs=[_new(1)]),  # already exists
    BatchPlan(1, [], [], forks=[Fork(7, 8)]),  # unknown parent
    BatchPlan(1, [], [], swap_out=[(0, 4)]),  # CPU block out of range
    BatchPlan(1, [], [], copies=[(0, -1)]),
    BatchPlan(1, [], [], append_tokens=[(1, 10**6)]),  # token outside the vocabulary
    BatchPlan(1, [2], [20], new_seqs=[_new(2, n=20, blocks=[1])]),  # 20 tokens do not fit one block of 16
])
def test_invalid_plans_fail_the_step_and_change_nothing(runner, bad):
    first = runner.execute(BatchPlan(0, [1], [3], new_seqs=[_new(1)]))
    assert first.error is None
    before = _state(runner)
    res = runner.execute(bad)
    assert res.error and res.error.startswith("invalid plan") and res.step_id == 1
    assert _state(runner) == before
    assert runner.execute(BatchPlan(2, [1], [2])).error is None  # still usable


def test_freeing_unknown_sequences_is_harmless(runner):
    assert runner.execute(BatchPlan(0, [], [], free_seq_ids=[42])).error is None


def test_state_follows_the_deltas(runner):
    res = runner.execute(BatchPlan(0, [1], [5], new_seqs=[_new(1)]))
    assert res.sampled_seq_ids == [1]
    s = runner.seqs[1]
    assert s.num_computed_tokens == 5 and len(s.token_ids) == 6 and s.token_ids[-1] == res.sampled_token_ids[0]
    res = runner.execute(BatchPlan(1, [2], [1], forks=[Fork(1, 2, seed=5)],
                                   block_updates=[BlockUpdate(2, 0, [3])], free_seq_ids=[]))
    child = runner.seqs[2]
    assert child.block_ids == [3] and child.sampling.seed == 5 and runner.seqs[1].block_ids == [0]
    runner.reset()
    assert runner.seqs == {}


def test_partial_prefill_does_not_sample(runner):
    res = runner.execute(BatchPlan(0, [1], [3], new_seqs=[_new(1)]))
    assert res.sampled_seq_ids == [] and runner.seqs[1].num_computed_tokens == 3


def test_seeded_sampling_alone_equals_in_batch_and_after_recompute(tiny_llama_dir, model):
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, want_logprobs=True, logprobs=2)
    prompt = list(range(30, 47))

    def run(extra_seqs: int, stop_at: int | None = None) -> list[int]:
        drv = PlanDriver(make_runner(tiny_llama_dir, model=model))
        drv.add(0, prompt, params)
        for i in range(extra_seqs):
            drv.add(i + 1, list(range(60 + i, 70 + 2 * i)), SamplingParams(temperature=1.0))
        drv.run_until(stop_at or 12)
        return drv.seqs[0].outputs

    alone = run(0)
    assert run(3) == alone
    # Preempted by recompute after 5 tokens: re-sent with its outputs, it continues identically.
    drv = PlanDriver(make_runner(tiny_llama_dir, model=model))
    drv.add(0, prompt + alone[:5], params, num_prompt=len(prompt))
    drv.run_until(7)
    assert alone[:5] + drv.seqs[0].outputs == alone


def test_logprobs_are_reported_per_sampled_sequence(runner):
    p = SamplingParams(temperature=0.0, want_logprobs=True, logprobs=3)
    res = runner.execute(BatchPlan(0, [1, 2], [5, 5], new_seqs=[_new(1, sampling=p), _new(2, blocks=[1])]))
    assert [lp.seq_id for lp in res.logprobs] == [1]
    lp = res.logprobs[0]
    assert lp.top_token_ids[0] == res.sampled_token_ids[0] and lp.token_logprob == lp.top_logprobs[0]
    assert res.model_seconds > 0


def test_a_step_whose_sampler_missed_a_row_appends_no_token_to_any_sequence():
    """All or nothing: a tensor-parallel group's other ranks append nothing for a failed step, so
    rank 0 must not keep the rows it reported before the bad one."""
    from executor_svc.runner import ModelRunner, SeqState
    from executor_svc.sampler import SampleOutput
    from pagedserve.wire import SamplingParams, StepResult

    seqs = [SeqState(1, [5, 6], 2, [], 2, SamplingParams()), SeqState(2, [7], 1, [], 1, SamplingParams())]
    with pytest.raises(RuntimeError, match="no token for seq 2"):
        ModelRunner._report(None, seqs, SampleOutput([9, None], [None, None], [None, None]), StepResult(1))
    assert [s.token_ids for s in seqs] == [[5, 6], [7]]
