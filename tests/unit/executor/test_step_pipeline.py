"""StepPipeline: each plan prepared while the step before is in flight gives the sequential
runner's tokens exactly, and a failing step fails the one prepared on top of it, nothing else.

The real Scheduler plans ahead as the engine's asynchronous loop does (two plans in flight),
so most decode steps take their input token from the step still running."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_svc.model import load_model
from executor_svc.pipeline import StepPipeline
from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.wire import BatchPlan, BlockUpdate, Fork, NewSeq, SamplingParams, pack_ids
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing.executor_plans import apply_result, hf_greedy, make_runner, serve_requests

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir)


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(5)
    return {f"r{i}": torch.randint(1, 500, (n,), generator=g).tolist() for i, n in enumerate([21, 30, 17, 26])}


class Counting:
    """Counts the launches whose inputs included a token still being sampled, and those of them
    that took it on the device (chained: launched before the step sampling it completed)."""

    def __init__(self, runner) -> None:
        self.ahead = self.chained = 0
        launch = runner._launch

        def counted(step, chain, *args):
            self.ahead += bool(step.batch is not None and step.batch.in_flight_inputs)
            self.chained += chain is not None
            return launch(step, chain, *args)

        runner._launch = counted


def serve_pipelined(runner, sched: Scheduler, reqs: dict) -> dict[str, list[list[int]]]:
    """serve_requests (executor_plans.py) with two plans in flight and a StepPipeline."""
    out: dict[str, list[list[int]]] = {rid: [] for rid in reqs}
    for req in reqs.values():
        sched.add_request(req)
    pipe = StepPipeline(runner)
    for _ in range(2000):
        plan = sched.schedule() if len(sched.in_flight) < 2 else None
        if plan is not None:
            results = pipe.push(plan)
        elif pipe.in_flight is not None:
            results = [pipe.finish()]
        elif not sched.has_work():
            return out
        else:
            continue
        for result in results:
            apply_result(sched, result, out)
    raise AssertionError("scheduler did not finish")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_greedy_outputs_under_preemption_equal_transformers(tiny_llama_dir, model, mode):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    runner = make_runner(tiny_llama_dir, num_blocks=8, num_cpu_blocks=32, model=model)
    counting = Counting(runner)
    sched = Scheduler(SchedulerConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=48, max_model_len=256,
                                      preemption_mode=mode), 8, 32, eos_token_ids=())
    params = RequestParams(max_tokens=24, sampling=GREEDY, ignore_eos=True)
    prompts = _prompts()
    out = serve_pipelined(runner, sched, {rid: GenerationRequest(rid, p, params) for rid, p in prompts.items()})
    assert sched.num_preemptions > 0
    assert counting.ahead > 10  # most decode steps took a token that was still being sampled
    assert counting.chained > 10  # (greedy: most of them took it on the device)
    for rid, p in prompts.items():
        assert out[rid] == [hf_greedy(hf, p, 24)], rid
    assert sched.block_stats()["used"] == 0


@pytest.mark.parametrize("sampling", [
    dict(n=3, sampling=SamplingParams(temperature=0.9, top_k=40, seed=7)),  # forks: prepared after the step
    dict(beam_width=3, sampling=SamplingParams(temperature=0.0)),  # appended tokens: the same
    dict(sampling=SamplingParams(temperature=1.0, seed=3, repetition_penalty=1.3, logprobs=2)),
    dict(sampling=SamplingParams(temperature=0.0, want_logprobs=True, logprobs=2)),  # greedy, sampled on the host
    dict(sampling=SamplingParams(temperature=0.0, min_tokens=5, end_token_ids=[7, 9])),  # end tokens held back
], ids=["n3-seeded", "beam", "penalties-logprobs", "greedy-logprobs", "greedy-min-tokens"])
def test_sampled_choices_beams_and_penalties_equal_the_sequential_runner(tiny_llama_dir, model, sampling):
    prompt = _prompts()["r1"]

    def serve(pipelined: bool) -> dict:
        runner = make_runner(tiny_llama_dir, num_blocks=48, model=model)
        sched = Scheduler(SchedulerConfig(block_size=16, max_model_len=256), 48, 8, eos_token_ids=())
        reqs = {f"a{i}": GenerationRequest(f"a{i}", prompt[i:], RequestParams(max_tokens=12, ignore_eos=True,
                                                                             **sampling)) for i in range(3)}
        return (serve_pipelined if pipelined else serve_requests)(runner, sched, reqs)

    assert serve(True) == serve(False)


def test_greedy_tokens_chained_through_decode_graphs_equal_the_sequential_runner(tiny_llama_dir, model):
    """Chained steps replayed from the decode graphs (their CPU twin): the open rows are written into
    the static inputs behind the one copy, and the tokens are the plain runner's."""
    from executor_svc.decode_graphs import DecodeGraphs

    prompts = _prompts()

    def serve(pipelined: bool):
        runner = make_runner(tiny_llama_dir, num_blocks=48, model=model)
        counting = Counting(runner)
        if pipelined:
            runner.graphs = DecodeGraphs(runner.model, runner.kv, runner.backend, 256, (1, 2, 4, 8), capture=False)
            runner.graphs.capture_all()
        sched = Scheduler(SchedulerConfig(block_size=16, max_model_len=256), 48, 8, eos_token_ids=())
        reqs = {rid: GenerationRequest(rid, p, RequestParams(max_tokens=10 + i, sampling=GREEDY, ignore_eos=True))
                for i, (rid, p) in enumerate(prompts.items())}
        return (serve_pipelined if pipelined else serve_requests)(runner, sched, reqs), runner, counting

    (out, runner, counting), (want, _, _) = serve(True), serve(False)
    assert out == want
    assert counting.chained > 10 and runner.graphs.replays > 10
    assert runner.graphs.inputs.copies == runner.graphs.replays + len(runner.graphs.sizes)  # one copy a step


def _decode_plans(runner, n: int = 3) -> None:
    """Two sequences prefilled, their first tokens sampled (the runner holds their state)."""
    plan = BatchPlan(0, [1, 2], [n, n], new_seqs=[NewSeq(sid, pack_ids(range(10 + sid, 10 + sid + n)), n, [sid], 0, GREEDY)
                                                   for sid in (1, 2)])
    assert runner.execute(plan).error is None


@pytest.mark.parametrize("fault,chain", [("sampler", False), ("report", False), ("report", True)])
def test_a_failed_step_leaves_only_its_sequences_out_of_the_step_prepared_on_it(tiny_llama_dir, model, monkeypatch,
                                                                                fault, chain):
    """Step 1's sampling fails for seqs 1 and 2 after step 2 (which also admits seq 3) was prepared
    on it: step 2 serves seq 3 only, exactly as the sequential runner does. Unchained, step 2 is
    launched without them; chained (step 1's greedy tokens on the device, step 2 launched before
    step 1 completes), their rows ran in step 2 and it reports nothing of them."""
    import executor_svc.step_report as step_report

    def run(pipelined: bool) -> list:
        runner = make_runner(tiny_llama_dir, num_blocks=8, model=model)
        _decode_plans(runner)
        target, name = (runner.sampler, "sample") if fault == "sampler" else (step_report, "report_samples")
        real, calls = getattr(target, name), []

        def fails_once(*args):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("device fault")
            return real(*args)

        monkeypatch.setattr(target, name, fails_once)
        plans = [BatchPlan(1, [1, 2], [1, 1]),
                 BatchPlan(2, [1, 2, 3], [1, 1, 4], new_seqs=[NewSeq(3, pack_ids([5, 6, 7, 8]), 4, [3], 0, GREEDY)]),
                 BatchPlan(3, [3], [1], free_seq_ids=[1, 2])]
        if pipelined:
            pipe = StepPipeline(runner, chain=chain)
            results = [r for p in plans for r in pipe.push(p)] + [pipe.finish()]
            assert pipe.chained == (2 if chain else 0)  # steps 2 and 3, each on the tokens of the one before
        else:
            results = [runner.execute(p) for p in plans]
        monkeypatch.undo()
        assert not runner.dropped and set(runner.seqs) == {3}
        return [(r.step_id, r.failed_seq_ids, r.sampled_seq_ids, r.sampled_token_ids) for r in results]

    sequential = run(False)
    assert [(step, failed, sampled) for step, failed, sampled, _ in sequential] == [
        (1, [1, 2], []), (2, [], [3]), (3, [], [3])]
    assert run(True) == sequential


def test_a_plan_refused_while_prepared_ahead_comes_after_the_step_in_flight(tiny_llama_dir, model):
    runner = make_runner(tiny_llama_dir, num_blocks=8, model=model)
    _decode_plans(runner)
    pipe = StepPipeline(runner)
    assert pipe.push(BatchPlan(1, [1, 2], [1, 1])) == []
    before = {sid: (list(s.token_ids), s.num_computed_tokens) for sid, s in runner.seqs.items()}
    done = pipe.push(BatchPlan(2, [1, 9], [1, 1]))  # seq 9 does not exist
    assert [(r.step_id, r.error is None) for r in done] == [(1, True), (2, False)]
    assert done[1].refused and "invalid plan" in done[1].error and pipe.in_flight is None
    for sid, (tokens, computed) in before.items():  # step 1's tokens appended, nothing of step 2 applied
        assert runner.seqs[sid].token_ids == tokens + [done[0].sampled_token_ids[done[0].sampled_seq_ids.index(sid)]]
        assert runner.seqs[sid].num_computed_tokens == computed


@pytest.mark.parametrize("second", [
    BatchPlan(2, [4], [1], forks=[Fork(1, 4)], block_updates=[BlockUpdate(4, 0, [5])]),
    BatchPlan(2, [1], [2], append_tokens=[(1, 42)]),
], ids=["fork", "append"])
def test_a_plan_that_copies_or_extends_a_sequence_in_flight_waits_for_its_token(tiny_llama_dir, model, second):
    """The scheduler plans neither ahead (forks copy prompts only; beams wait for their results),
    but a plan that did must see the token first, as the sequential runner does."""
    def run(pipelined: bool) -> list:
        runner = make_runner(tiny_llama_dir, num_blocks=8, model=model)
        _decode_plans(runner)
        plans = [BatchPlan(1, [1], [1]), second]
        if not pipelined:
            results = [runner.execute(p) for p in plans]
        else:
            pipe = StepPipeline(runner)
            results = [r for p in plans for r in pipe.push(p)] + [pipe.finish()]
        return [(r.step_id, r.error, r.sampled_seq_ids, r.sampled_token_ids) for r in results]

    sequential = run(False)
    assert all(error is None for _, error, *_ in sequential)
    assert run(True) == sequential
