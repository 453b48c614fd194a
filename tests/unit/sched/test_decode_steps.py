"""Plans of several decode steps (``BatchPlan.decode_steps``) change no output.

The real Scheduler drives the real CPU runner, one plan or two in flight (as the engine's loops
do), with up to 4 decode steps per plan against 1: greedy and seeded sampling with penalties give
the same tokens, an end inside a plan's steps (EOS, a stop token, the length) drops the tokens
after it, the blocks the dropped steps took are freed, and what the cached prefix holds is the
same. The scheduler takes several steps only when every running request decodes plainly and
nothing waits; the executor refuses a plan of several steps that is not that.
"""

from __future__ import annotations

from collections import deque

import pytest

from pagedserve.engine_api import FinishReason, GenerationRequest, RequestParams
from pagedserve.wire import BatchPlan, SamplingParams, StepResult
from scheduler_svc.sched import decode_steps as decode_steps_module
from scheduler_svc.sched.in_flight import ProtocolError
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing.executor_plans import make_runner

NUM_BLOCKS = 64
EOS = 2


@pytest.fixture(autouse=True)
def plans_of_any_length(monkeypatch):
    """The step count a plan takes here depends on its sequences alone, not on this machine's speed
    (test_a_plan_takes_as_many_steps_as_fit_its_time sets the time a plan may last)."""
    monkeypatch.setattr(decode_steps_module, "DECODE_PLAN_S", 1e9)


def _prompt(i: int, n: int) -> list[int]:
    return [(37 * i + 11 * j) % 480 + 5 for j in range(n)]


def _serve(model_dir, model, reqs: list[GenerationRequest], steps: int, depth: int, eos=(),
           arrivals: dict[int, list[GenerationRequest]] | None = None):
    """Serve ``reqs`` (and ``arrivals[plan number]`` as they come) to the end with ``steps`` decode
    steps per plan at most and ``depth`` plans in flight: (request id -> (tokens, finish reason),
    plans, the scheduler)."""
    runner = make_runner(model_dir, num_blocks=NUM_BLOCKS, model=model)
    runner.max_decode_steps = steps
    sched = Scheduler(SchedulerConfig(block_size=16, max_model_len=256, decode_steps=steps), NUM_BLOCKS, 16,
                      eos_token_ids=eos)
    for r in reqs:
        sched.add_request(r)
    out: dict[str, tuple[list[int], FinishReason | None]] = {}
    plans: list[BatchPlan] = []
    pending: deque[BatchPlan] = deque()
    arrivals = dict(arrivals or {})
    for _ in range(2000):
        while len(pending) < depth and (plan := sched.schedule()) is not None:
            pending.append(plan)
            plans.append(plan)
            for r in arrivals.pop(len(plans), []):
                sched.add_request(r)
        if not pending:
            if not sched.has_work() and not arrivals:
                break
            continue
        result = runner.execute(pending.popleft())
        assert result.error is None and not result.refused, result.error
        for upd in sched.update(result):
            assert upd.error is None
            toks, reason = out.get(upd.request_id, ([], None))
            for s in upd.seqs:
                toks = toks + s.new_token_ids
                reason = s.finish_reason or reason
            out[upd.request_id] = (toks, reason)
        sched.check_integrity()
    else:
        raise AssertionError("the scheduler did not finish")
    assert sched.kv.num_free_blocks == NUM_BLOCKS  # every block back, the dropped steps' included
    return out, plans, sched


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    from executor_svc.model import load_model
    return load_model(tiny_llama_dir)


def _workload() -> list[GenerationRequest]:
    greedy = [GenerationRequest(f"g{i}", _prompt(i, 9 + 5 * i), RequestParams(
        max_tokens=7 + 6 * i, sampling=SamplingParams(temperature=0.0), ignore_eos=True)) for i in range(3)]
    sampled = [GenerationRequest(f"s{i}", _prompt(10 + i, 20), RequestParams(
        max_tokens=30, ignore_eos=True, sampling=SamplingParams(
            temperature=0.9, top_p=0.9, top_k=40, seed=5 + i, repetition_penalty=1.2, presence_penalty=0.5,
            frequency_penalty=0.3, min_tokens=3))) for i in range(2)]
    return greedy + sampled


@pytest.mark.parametrize("depth", [1, 2])
def test_several_decode_steps_per_plan_give_the_same_tokens(tiny_llama_dir, model, depth):
    one, plans_one, _ = _serve(tiny_llama_dir, model, _workload(), 1, depth)
    four, plans_four, _ = _serve(tiny_llama_dir, model, _workload(), 4, depth)
    assert four == one
    assert all(p.decode_steps == 1 for p in plans_one)
    multi = [p for p in plans_four if p.decode_steps > 1]
    assert multi and max(p.decode_steps for p in multi) == 4
    assert len(plans_four) < len(plans_one) * 0.6  # the same tokens in fewer plans


def test_an_end_inside_a_plans_steps_drops_the_tokens_after_it(tiny_llama_dir, model):
    """The greedy continuation's 6th and 11th tokens made EOS and a stop token: both runs end there,
    the tokens a plan computed past them never reach the client, and their blocks are freed."""
    probe, _, _ = _serve(tiny_llama_dir, model, [GenerationRequest("p", _prompt(3, 14), RequestParams(
        max_tokens=40, sampling=SamplingParams(temperature=0.0), ignore_eos=True))], 1, 1)
    toks = probe["p"][0]
    eos, stop = toks[5], toks[10]
    assert eos not in toks[:5] and stop not in toks[:10], "pick another prompt: the ends repeat earlier"

    def reqs():
        return [GenerationRequest("eos", _prompt(3, 14), RequestParams(max_tokens=40, sampling=SamplingParams(
                    temperature=0.0))),
                GenerationRequest("stop", _prompt(3, 14), RequestParams(max_tokens=40, stop_token_ids=[stop],
                                                                        sampling=SamplingParams(temperature=0.0),
                                                                        ignore_eos=True)),
                GenerationRequest("len", _prompt(4, 14), RequestParams(max_tokens=9, ignore_eos=True,
                                                                       sampling=SamplingParams(temperature=0.0)))]

    for depth in (1, 2):
        one, _, _ = _serve(tiny_llama_dir, model, reqs(), 1, depth, eos=(eos,))
        four, plans, _ = _serve(tiny_llama_dir, model, reqs(), 4, depth, eos=(eos,))
        assert four == one
        assert one["eos"] == (toks[:6], FinishReason.EOS)
        assert one["stop"] == (toks[:11], FinishReason.STOP)
        assert len(one["len"][0]) == 9 and one["len"][1] == FinishReason.LENGTH
        assert any(p.decode_steps > 1 for p in plans)


def test_the_blocks_a_plan_of_several_steps_filled_are_cached(tiny_llama_dir, model):
    """A follow-up whose prompt is a finished request's prompt and output hits the cache for the
    same tokens whichever way the output was decoded (the blocks filled inside a plan's steps, and
    the one its last token filled before the end freed it, are committed)."""
    first = GenerationRequest("a", _prompt(5, 16), RequestParams(max_tokens=37, ignore_eos=True,
                                                                 sampling=SamplingParams(temperature=0.0)))
    cached = []
    for steps in (1, 4):
        out, _, sched = _serve(tiny_llama_dir, model, [first], steps, 2)
        follow = GenerationRequest("b", first.prompt_token_ids + out["a"][0] + [9], RequestParams(
            max_tokens=2, ignore_eos=True, sampling=SamplingParams(temperature=0.0)))
        sched.add_request(follow)
        sched.schedule()
        cached.append(sched.requests["b"].num_cached_prompt_tokens)
    assert cached[0] == cached[1] == 48  # 16 + 37 - 1 computed tokens: 3 full blocks


def test_several_steps_only_when_every_running_request_decodes_plainly_and_none_waits(tiny_llama_dir, model):
    plain = RequestParams(max_tokens=12, ignore_eos=True, sampling=SamplingParams(temperature=0.0))
    logprobs = RequestParams(max_tokens=12, ignore_eos=True, sampling=SamplingParams(
        temperature=0.0, want_logprobs=True, logprobs=2))
    # A request with log-probs running: one step per plan throughout.
    _, plans, _ = _serve(tiny_llama_dir, model, [GenerationRequest("a", _prompt(1, 10), plain),
                                                 GenerationRequest("b", _prompt(2, 10), logprobs)], 4, 1)
    assert all(p.decode_steps == 1 for p in plans)
    # n > 1: its choices are one request of several sequences.
    n2 = RequestParams(max_tokens=12, n=2, ignore_eos=True, sampling=SamplingParams(temperature=0.8, seed=3))
    _, plans, _ = _serve(tiny_llama_dir, model, [GenerationRequest("n", _prompt(3, 10), n2)], 4, 1)
    assert all(p.decode_steps == 1 for p in plans)
    # A request arriving: the plan after it prefills it, one step; then several again.
    late = GenerationRequest("late", _prompt(4, 30), plain)
    _, plans, _ = _serve(tiny_llama_dir, model, [GenerationRequest("a", _prompt(1, 10), RequestParams(
        max_tokens=60, ignore_eos=True, sampling=SamplingParams(temperature=0.0)))], 4, 1, arrivals={4: [late]})
    prefill = next(i for i, p in enumerate(plans) if 30 in p.num_new_tokens or 29 in p.num_new_tokens)
    assert plans[prefill].decode_steps == 1 and plans[prefill - 1].decode_steps == 4
    assert plans[prefill + 1].decode_steps > 1
    # The steps stop at the length: no plan computes past max_tokens.
    _, plans, _ = _serve(tiny_llama_dir, model, [GenerationRequest("a", _prompt(1, 10), RequestParams(
        max_tokens=7, ignore_eos=True, sampling=SamplingParams(temperature=0.0)))], 4, 1)
    # 7 tokens: the prefill samples 1, a decode step measures the step time, then 4 and the 1 left.
    assert [p.decode_steps for p in plans if p.scheduled_seq_ids] == [1, 1, 4, 1]


def test_a_result_that_does_not_answer_every_step_breaks_the_contract(tiny_llama_dir, model):
    runner = make_runner(tiny_llama_dir, num_blocks=NUM_BLOCKS, model=model)
    runner.max_decode_steps = 4
    sched = Scheduler(SchedulerConfig(block_size=16, max_model_len=256, decode_steps=4), NUM_BLOCKS, 16, ())
    sched.add_request(GenerationRequest("a", _prompt(1, 10), RequestParams(
        max_tokens=20, ignore_eos=True, sampling=SamplingParams(temperature=0.0))))
    sched.update(runner.execute(sched.schedule()))  # the prefill
    sched.update(runner.execute(sched.schedule()))  # a decode step, whose time the scheduler learns
    plan = sched.schedule()
    assert plan.decode_steps == 4
    good = runner.execute(plan)
    assert len(good.sampled_token_ids) == 4
    short = StepResult(plan.step_id, good.sampled_seq_ids[:3], good.sampled_token_ids[:3])
    with pytest.raises(ProtocolError, match="x 4 steps"):
        sched.update(short)
    assert sched.update(good)[0].seqs[0].new_token_ids == good.sampled_token_ids  # nothing was applied


def _decoding_runner(tiny_llama_dir, model, max_steps: int = 4, **sampling):
    """A runner with seq 1 prefilled (10 tokens, 1 block of 16) and its first token sampled."""
    from pagedserve.wire import NewSeq, pack_ids
    runner = make_runner(tiny_llama_dir, num_blocks=NUM_BLOCKS, model=model)
    runner.max_decode_steps = max_steps
    sp = SamplingParams(temperature=0.0, **sampling)
    res = runner.execute(BatchPlan(1, [1], [10], new_seqs=[NewSeq(1, pack_ids(_prompt(1, 10)), 10, [3], 0, sp)]))
    assert res.sampled_seq_ids == [1]
    return runner


@pytest.mark.parametrize("plan, why", [
    (BatchPlan(2, [1], [1], decode_steps=5), "serves at most 4"),
    (BatchPlan(2, [1], [1], decode_steps=4, copies=[(3, 4)]), "only scheduled decodes"),
    (BatchPlan(2, [1], [1], decode_steps=4), None),  # positions 10..13: block 3 holds them
])
def test_the_executor_refuses_a_plan_of_several_steps_it_cannot_serve(tiny_llama_dir, model, plan, why):
    runner = _decoding_runner(tiny_llama_dir, model)
    res = runner.execute(plan)
    if why is None:
        assert not res.refused and res.sampled_seq_ids == [1] * 4
    else:
        assert res.refused and why in res.error


def test_the_executor_refuses_several_steps_past_the_block_table_or_for_log_probs(tiny_llama_dir, model):
    runner = _decoding_runner(tiny_llama_dir, model)
    res = runner.execute(BatchPlan(2, [1], [1], decode_steps=4))  # tokens 11..14: computed 14 of 15
    assert res.sampled_seq_ids == [1] * 4
    res = runner.execute(BatchPlan(3, [1], [1], decode_steps=3))  # would write positions 14..16: block 2 missing
    assert res.refused and "do not fit in 1 blocks" in res.error
    runner = _decoding_runner(tiny_llama_dir, model, want_logprobs=True, logprobs=1)
    res = runner.execute(BatchPlan(2, [1], [1], decode_steps=2))
    assert res.refused and "one decode step per plan" in res.error
    runner = _decoding_runner(tiny_llama_dir, model, max_steps=1)
    res = runner.execute(BatchPlan(2, [1], [1], decode_steps=2))
    assert res.refused and "serves at most 1" in res.error


@pytest.mark.parametrize("step_s, steps", [(0.004, 4), (0.010, 2), (0.030, 1)])
def test_a_plan_takes_as_many_steps_as_fit_its_time(tiny_llama_dir, model, monkeypatch, step_s, steps):
    """Up to DECODE_PLAN_S of decode steps at the step time the results report (here, as if each step
    took ``step_s``): a slow model's tokens do not stream in bursts."""
    monkeypatch.setattr(decode_steps_module, "DECODE_PLAN_S", 0.025)
    runner = make_runner(tiny_llama_dir, num_blocks=NUM_BLOCKS, model=model)
    runner.max_decode_steps = 4
    sched = Scheduler(SchedulerConfig(block_size=16, max_model_len=256, decode_steps=4), NUM_BLOCKS, 16, ())
    sched.add_request(GenerationRequest("a", _prompt(1, 10), RequestParams(
        max_tokens=30, ignore_eos=True, sampling=SamplingParams(temperature=0.0))))
    taken = []
    while (plan := sched.schedule()) is not None:
        result = runner.execute(plan)
        result.model_seconds = step_s * plan.decode_steps
        sched.update(result)
        sched.check_integrity()
        taken.append(plan.decode_steps)
    assert taken[:2] == [1, 1]  # the prefill, then a decode step that measures the step time
    assert taken[2] == steps and max(taken) == steps
    assert sched.decode_policy.step_s == pytest.approx(step_s)


class _PhaseRecorder:
    """Wraps a runner's phases and hooks, recording each call in order."""

    def __init__(self, runner, monkeypatch) -> None:
        self.calls: list[str] = []
        for name in ("prepare", "launch", "complete", "_publish", "_guard", "_sampled"):
            inner = getattr(runner, name)
            monkeypatch.setattr(runner, name, self._wrap(name, inner))

    def _wrap(self, name, inner):
        def call(*args, **kwargs):
            self.calls.append(name)
            return inner(*args, **kwargs)
        return call


def test_each_decode_step_of_a_plan_runs_through_the_three_phases_and_their_hooks(tiny_llama_dir, model,
                                                                                  monkeypatch):
    runner = _decoding_runner(tiny_llama_dir, model)
    runner.keep_logits = True
    rec = _PhaseRecorder(runner, monkeypatch)
    res = runner.execute(BatchPlan(2, [1], [1], decode_steps=3))
    step = ["prepare", "_publish", "_guard", "launch", "_guard", "complete", "_sampled"]
    assert rec.calls == step * 3  # the hooks (tensor parallelism's) see every step as a plan of its own
    assert res.sampled_seq_ids == [1] * 3 and runner.seqs[1].num_computed_tokens == 13
    assert runner.seqs[1].token_ids[-3:] == res.sampled_token_ids
    # The phases' bookkeeping holds for the last step too: its logits are what the runner kept.
    assert int(runner.last_logits[0].argmax()) == res.sampled_token_ids[-1]


def test_a_decode_step_that_fails_fails_the_plans_sequences_and_the_runner_serves_on(tiny_llama_dir, model,
                                                                                     monkeypatch):
    runner = _decoding_runner(tiny_llama_dir, model)
    from pagedserve.wire import NewSeq, pack_ids
    res = runner.execute(BatchPlan(2, [2], [10], new_seqs=[NewSeq(2, pack_ids(_prompt(2, 10)), 10, [4], 0,
                                                                  SamplingParams(temperature=0.0))]))
    assert res.sampled_seq_ids == [2]
    forward, calls = runner._forward_batch, []

    def second_step_fails(plan, batch, *chain):
        calls.append(plan.scheduled_seq_ids)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return forward(plan, batch, *chain)

    monkeypatch.setattr(runner, "_forward_batch", second_step_fails)
    res = runner.execute(BatchPlan(3, [1, 2], [1, 1], decode_steps=3))
    assert sorted(res.failed_seq_ids) == [1, 2] and res.sampled_seq_ids == [] and "boom" in res.error
    assert not res.refused and 1 not in runner.seqs and 2 not in runner.seqs  # dropped, first tokens with them
    # A plan sent before the scheduler heard skips them; the runner still serves a new sequence.
    monkeypatch.setattr(runner, "_forward_batch", forward)
    res = runner.execute(BatchPlan(4, [1, 2, 3], [1, 1, 5], new_seqs=[NewSeq(3, pack_ids(_prompt(3, 5)), 5, [5], 0,
                                                                         SamplingParams(temperature=0.0))]))
    assert res.error is None and res.sampled_seq_ids == [3]
