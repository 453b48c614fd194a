"""ModelRunner: plan validation, state bookkeeping, seeded sampling through the model."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from executor_svc.batch import SeqState, build_batch
from executor_svc.model import load_model
from pagedserve.wire import BatchPlan, BlockUpdate, Fork, NewSeq, SamplingParams, pack_ids
from testing.executor_plans import PlanDriver, make_runner
from testing.plan_driver import GREEDY


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture
def runner(tiny_llama_dir, model):
    return make_runner(tiny_llama_dir, num_blocks=32, num_cpu_blocks=4, model=model)


def _new(sid: int, n: int = 5, blocks=(0,), computed: int = 0, sampling=GREEDY) -> NewSeq:
    return NewSeq(sid, pack_ids(range(10, 10 + n)), n, list(blocks), computed, sampling)


def _state(runner):
    return {sid: (list(s.token_ids), list(s.block_ids), s.num_computed_tokens) for sid, s in runner.seqs.items()}


@pytest.mark.parametrize("bad,at_fault", [
    (BatchPlan(1, [99], [1]), 99),  # unknown scheduled seq
    (BatchPlan(1, [1], [1], block_updates=[BlockUpdate(1, 1, [32])]), 1),  # block id out of range
    (BatchPlan(1, [1], [1], block_updates=[BlockUpdate(1, 5, [2])]), 1),  # start beyond the table
    (BatchPlan(1, [1], [10]), 1),  # more new tokens than the sequence holds
    (BatchPlan(1, [1, 1], [1, 1]), None),  # scheduled twice
    (BatchPlan(1, [], [], new_seqs=[_new(1)]), 1),  # already exists
    (BatchPlan(1, [], [], forks=[Fork(7, 8)]), 8),  # unknown parent
    (BatchPlan(1, [], [], swap_out=[(0, 4)]), None),  # CPU block out of range
    (BatchPlan(1, [], [], copies=[(0, -1)]), None),
    (BatchPlan(1, [], [], append_tokens=[(1, 10**6)]), 1),  # token outside the vocabulary
    (BatchPlan(1, [2], [20], new_seqs=[_new(2, n=20, blocks=[1])]), 2),  # 20 tokens do not fit one block of 16
    (BatchPlan(1, [], [], new_seqs=[NewSeq(2, pack_ids([5, 10**6, 6]), 3, [1], 0, GREEDY)]), 2),  # outside the vocab
    (BatchPlan(1, [], [], new_seqs=[NewSeq(2, pack_ids([5, 6])[:-1], 2, [1], 0, GREEDY)]), 2),  # not whole uint32s
    (BatchPlan(1, [], [], new_seqs=[NewSeq(2, b"", 0, [1], 0, GREEDY)]), 2),  # no tokens
])
def test_an_invalid_plan_is_refused_whole_and_so_is_every_plan_after_it_until_a_reset(runner, bad, at_fault):
    first = runner.execute(BatchPlan(0, [1], [3], new_seqs=[_new(1)]))
    assert first.error is None
    before = _state(runner)
    res = runner.execute(bad)
    assert res.refused and res.error.startswith("invalid plan") and res.step_id == 1
    assert res.failed_seq_ids == ([] if at_fault is None else [at_fault])  # the sequence at fault, if one is
    assert _state(runner) == before
    behind = runner.execute(BatchPlan(2, [1], [2]))  # built on the refused one: never applied
    assert behind.refused and behind.error.startswith("discarded") and _state(runner) == before
    runner.reset()
    assert runner.execute(BatchPlan(3, [1], [3], new_seqs=[_new(1)])).error is None  # serves again


def _fail_once(monkeypatch, owner, name: str) -> None:
    original = getattr(owner, name)
    calls = []

    def broken(*args, **kwargs):
        if not calls:
            calls.append(1)
            raise RuntimeError("device error")
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, broken)


def test_a_failed_forward_drops_its_sequences_and_the_plans_behind_it_skip_them(runner, monkeypatch):
    runner.execute(BatchPlan(0, [1, 2], [5, 5], new_seqs=[_new(1), _new(2, blocks=[1])]))
    _fail_once(monkeypatch, runner, "_forward_batch")
    failed = runner.execute(BatchPlan(1, [1], [1]))
    assert failed.failed_seq_ids == [1] and not failed.refused and "device error" in failed.error
    assert 1 not in runner.seqs and runner.refusing is None
    # A plan sent before the scheduler learned of it still names seq 1 (scheduled, a block, a fork).
    behind = runner.execute(BatchPlan(2, [1, 2, 3], [1, 1, 1], forks=[Fork(1, 3)],
                                      block_updates=[BlockUpdate(1, 1, [5])]))
    assert behind.error is None and behind.sampled_seq_ids == [2] and behind.failed_seq_ids == []
    assert set(runner.seqs) == {2}  # the child of a dropped parent is dropped with it
    assert runner.execute(BatchPlan(3, [2], [1], free_seq_ids=[1, 3])).sampled_seq_ids == [2]
    assert not runner.dropped  # freed: nothing is remembered any more


def test_a_failed_sampler_fails_only_the_sampling_sequences(runner, monkeypatch):
    _fail_once(monkeypatch, runner.sampler, "sample")
    res = runner.execute(BatchPlan(0, [1, 2], [5, 3], new_seqs=[_new(1), _new(2, blocks=[1])]))
    assert res.failed_seq_ids == [1] and res.sampled_seq_ids == []  # seq 2 computed a prefill chunk
    assert runner.seqs[2].num_computed_tokens == 3
    assert runner.execute(BatchPlan(1, [2], [2])).sampled_seq_ids == [2]


def test_a_plan_that_fails_while_applied_fails_what_it_names_and_refuses_until_a_reset(runner, monkeypatch):
    runner.execute(BatchPlan(0, [1], [5], new_seqs=[_new(1)]))
    _fail_once(monkeypatch, runner.backend, "copy_blocks")
    res = runner.execute(BatchPlan(1, [1, 2], [1, 5], new_seqs=[_new(2, blocks=[1])], copies=[(0, 2)]))
    assert sorted(res.failed_seq_ids) == [1, 2] and not res.refused
    assert runner.execute(BatchPlan(2, [], [], new_seqs=[_new(3, blocks=[3])])).refused


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
    assert list(child.block_ids) == [3] and child.sampling.seed == 5 and list(runner.seqs[1].block_ids) == [0]
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
    from executor_svc.runner import SeqState
    from executor_svc.sampler import SampleOutput
    from executor_svc.step_report import report_samples
    from pagedserve.wire import SamplingParams, StepResult

    seqs = [SeqState(1, [5, 6], 2, [], 2, SamplingParams()), SeqState(2, [7], 1, [], 1, SamplingParams())]
    result = StepResult(1)
    with pytest.raises(RuntimeError, match="no token for seq 2"):
        report_samples(seqs, SampleOutput([9, None], [None, None], [None, None]), result, {}, None)
    assert [s.token_ids for s in seqs] == [[5, 6], [7]] and result.sampled_seq_ids == []


def _reference_batch(runner, seq_ids, num_new):
    """The batch layout spelled out one sequence at a time (the vectorised build must agree)."""
    bs = runner.kv.block_size
    ids, pos, slots, starts, lens, tables, rows, sample_ids = [], [], [], [0], [], [], [], []
    for sid, n in zip(seq_ids, num_new, strict=True):
        s = runner.seqs[sid]
        begin, end = s.num_computed_tokens, s.num_computed_tokens + n
        table = list(s.block_ids[: -(-end // bs)])
        for p in range(begin, end):
            ids.append(s.token_ids[p])
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
        starts.append(starts[-1] + n)
        lens.append(end)
        tables.append(table)
        if end == len(s.token_ids):
            rows.append(starts[-1] - 1)
            sample_ids.append(sid)
    width = max(len(t) for t in tables)
    return ids, pos, slots, starts, lens, [t + [0] * (width - len(t)) for t in tables], rows, sample_ids


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(1, 70), st.integers(0, 69), st.integers(1, 40), st.booleans()),
                min_size=1, max_size=12),
       st.randoms(use_true_random=False))
def test_batch_layout_matches_the_per_sequence_reference(runner, shapes, rnd):
    """Prefill chunks, decodes and sequences left partly computed, in any order and mix."""
    runner.reset()
    bs = runner.kv.block_size
    seq_ids, num_new = [], []
    for i, (length, computed, new, to_end) in enumerate(shapes):
        computed = min(computed, length - 1)
        n = length - computed if to_end else min(new, length - computed)
        sid = 100 + i * 3
        runner.seqs[sid] = SeqState(sid, [rnd.randrange(2, 500) for _ in range(length)], min(length, 5),
                                    rnd.sample(range(1000), -(-length // bs) + rnd.randrange(2)), computed, GREEDY)
        seq_ids.append(sid)
        num_new.append(n)
    batch = build_batch(runner.seqs, bs, runner.model.device, seq_ids, num_new)
    ids, pos, slots, starts, lens, tables, rows, sample_ids = _reference_batch(runner, seq_ids, num_new)
    meta = batch.meta
    assert batch.token_ids == ids and batch.positions.tolist() == pos
    assert meta.slot_mapping.tolist() == slots and meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.tolist() == starts == meta.query_start_loc_host
    assert meta.seq_lens.tolist() == lens == meta.seq_lens_host
    assert meta.block_tables.tolist() == tables and meta.block_tables.dtype == torch.int32
    assert (meta.max_query_len, meta.max_seq_len) == (max(num_new), max(lens))
    assert batch.logits_rows == rows and batch.sample_seq_ids == sample_ids
