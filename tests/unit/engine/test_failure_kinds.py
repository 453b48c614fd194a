"""Each failure kind fails at most the requests it touched, under steady arrivals.

The real engine and Scheduler, asynchronous scheduling (two plans in flight per executor), fake
executors behind the real ZeroMQ worker (testing/fake_engine.py). A request arrives every few
milliseconds; one fault is injected while they run:

* a plan the executor refuses (its sequence state and the scheduler's have parted);
* a step the executor could not serve for some sequences (a device error);
* a result that breaks the contract (a token id outside the vocabulary);
* an executor lost while a request is longer than what the survivor can hold;
* an abort racing the result that finishes the request.

Every request the fault did not touch must complete with the output it has without the fault
(the fake model's tokens depend only on the history: greedy, token for token), and every admitted
request must end exactly once in the metrics.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve import wire
from pagedserve.engine_api import EngineError, ErrorKind
from scheduler_svc.telemetry.metrics import Metrics
from testing.fake_engine import collect, engine_executor, req, run, running, settle
from testing.grpc_fakes import make_tokenizer

POISON = 61  # a prompt holding this token is the one the fault touches
ARRIVAL_S = 0.004  # one request every 4 ms: steady arrivals, a few per step


@pytest.fixture(scope="module")
def tokenizer():
    return make_tokenizer()


def workload(n: int = 40, victim: int | None = 10, max_tokens: int = 16):
    reqs = []
    for i in range(n):
        prompt = [3 + i % 50] + list(range(5, 20 + i % 7))
        if i == victim:
            prompt[1] = POISON
        reqs.append(req(f"r{i}", prompt, max_tokens + i % 5))
    return reqs


async def arrive(engine, reqs) -> dict[str, object]:
    """Submit ``reqs`` one every ARRIVAL_S; each one's tokens, or the exception it ended with."""
    async def one(r):
        try:
            return (await collect(engine, r))[0]
        except Exception as exc:  # noqa: BLE001  (what the test inspects)
            return exc

    tasks = []
    for r in reqs:
        tasks.append(asyncio.create_task(one(r)))
        await asyncio.sleep(ARRIVAL_S)
    return {r.request_id: out for r, out in zip(reqs, await asyncio.gather(*tasks), strict=True)}


def reference(tokenizer, reqs) -> dict[str, object]:
    async def main():
        async with running(tokenizer, 1) as (engine, _):
            return await arrive(engine, [_copy(r) for r in reqs])
    return run(main())


def _copy(r):
    return req(r.request_id, list(r.prompt_token_ids), r.params.max_tokens)


def ends_once(metrics: Metrics) -> None:
    """Every admitted request ended exactly once: admitted == finished, summed over the reasons."""
    value = metrics.registry.get_sample_value
    admitted = value("pagedserve:request_admitted_total")
    finished = sum(value("pagedserve:request_finished_total", {"reason": r}) or 0
                   for r in ("length", "stop", "eos", "aborted", "failed"))
    assert admitted == finished, (admitted, finished)


def seqs_of_victim(plan: wire.BatchPlan, runner) -> set[int]:
    """The victim's sequence ids, as they become known to this executor."""
    victims = runner.__dict__.setdefault("victims", set())
    victims.update(s.seq_id for s in plan.new_seqs if POISON in s.tokens())
    return victims


def assert_bystanders_unharmed(outs, ref, victim: str | None) -> None:
    for rid, out in outs.items():
        if rid != victim:
            assert out == ref[rid], f"{rid}: {out!r} instead of {ref[rid]!r}"


# ---------------------------------------------------------------- a refused plan

def test_a_refused_plan_fails_the_request_it_names_and_no_other(tokenizer):
    reqs = workload()
    ref = reference(tokenizer, reqs)

    def refuse_the_victim(plan, res, runner):
        if res is None and (hit := seqs_of_victim(plan, runner) & {s.seq_id for s in plan.new_seqs}):
            return wire.StepResult(plan.step_id, refused=True, failed_seq_ids=sorted(hit),
                                   error="invalid plan: injected")
        return None

    async def main():
        metrics = Metrics()
        async with running(tokenizer, 0, metrics=metrics) as (engine, execs):
            execs.append(engine_executor(engine, "ex", step_s=0.002, fault=refuse_the_victim))
            while not engine.slots:
                await asyncio.sleep(0.01)
            outs = await arrive(engine, reqs)
            assert isinstance(outs["r10"], EngineError) and outs["r10"].kind is ErrorKind.FAILED
            assert "refused" in str(outs["r10"]) and "injected" not in str(outs["r10"])  # the detail is logged
            assert_bystanders_unharmed(outs, ref, "r10")
            assert execs[0].runner.resets == 1  # one resynchronisation
            assert engine.slots["ex"].conn.state == "ready"  # the executor serves on
            await settle(engine)
        ends_once(metrics)

    run(main())


# ---------------------------------------------------------------- a failed step

@pytest.mark.parametrize("whole_step", [False, True], ids=["one-sequence", "whole-step"])
def test_a_failed_step_fails_only_the_requests_it_could_not_serve(tokenizer, whole_step):
    reqs = workload()
    ref = reference(tokenizer, reqs)
    touched: set[str] = set()

    def fail_the_victim_mid_decode(plan, res, runner):
        victims = seqs_of_victim(plan, runner)
        if res is None or not victims & set(plan.scheduled_seq_ids):
            return None
        runner.__dict__["victim_steps"] = runner.__dict__.get("victim_steps", 0) + 1
        if runner.__dict__["victim_steps"] != 4:
            return None
        failing = list(plan.scheduled_seq_ids) if whole_step else sorted(victims & set(plan.scheduled_seq_ids))
        runner.__dict__["failed"] = failing
        return runner.fail_seqs(res, failing)

    async def main():
        metrics = Metrics()
        async with running(tokenizer, 0, metrics=metrics) as (engine, execs):
            execs.append(engine_executor(engine, "ex", step_s=0.002, fault=fail_the_victim_mid_decode))
            while not engine.slots:
                await asyncio.sleep(0.01)
            slot = engine.slots["ex"]
            owner = {}
            original_update = slot.scheduler.update

            def update(result):  # which requests the failed sequences belonged to
                for sid in result.failed_seq_ids:
                    seq = slot.scheduler.seqs.get(sid)
                    if seq is not None:
                        owner[sid] = seq.request.request_id
                return original_update(result)

            slot.scheduler.update = update
            outs = await arrive(engine, reqs)
            touched.update(owner.values())
            assert "r10" in touched and (len(touched) > 1) == whole_step
            for rid in touched:
                assert isinstance(outs[rid], EngineError) and outs[rid].kind is ErrorKind.FAILED and "injected" not in str(outs[rid])
            for rid, out in outs.items():
                if rid not in touched:
                    assert out == ref[rid], rid
            assert slot.conn.state == "ready" and execs[0].runner.resets == 0
            await settle(engine)
        ends_once(metrics)

    run(main())


def test_an_executor_whose_every_step_fails_is_dropped_and_its_requests_fail_cleanly(tokenizer):
    def always(plan, res, runner):
        return runner.fail_seqs(res, list(plan.scheduled_seq_ids)) if res is not None and plan.scheduled_seq_ids \
            else None

    async def main():
        metrics = Metrics()
        async with running(tokenizer, 0, metrics=metrics, max_failed_steps=3) as (engine, execs):
            execs.append(engine_executor(engine, "broken", fault=always))
            while not engine.slots:
                await asyncio.sleep(0.01)
            conn = engine.slots["broken"].conn
            for i in range(3):  # one request, one failed step, at a time
                with pytest.raises(EngineError, match="the executor failed its step") as raised:
                    await collect(engine, req(f"b{i}", [3 + i, 4, 5]))
                assert raised.value.kind is ErrorKind.FAILED
            for _ in range(100):
                if conn.state == "dead":
                    break
                await asyncio.sleep(0.01)
            assert conn.state == "dead"  # dropped after three failed steps in a row
        ends_once(metrics)

    run(main())


def test_requests_whose_grammar_the_executor_rejects_fail_as_invalid_and_never_count_against_it(tokenizer):
    """Every step fails every sequence, each rejected for its request's own grammar: the requests fail
    INVALID (400) with the executor's reason, and the executor, which served them correctly, stays."""
    def reject(plan, res, runner):
        if res is None or not plan.scheduled_seq_ids or runner.__dict__.get("serve"):
            return None
        return runner.fail_seqs(res, list(plan.scheduled_seq_ids), rejected="the grammar does not compile here: x")

    async def main():
        metrics = Metrics()
        async with running(tokenizer, 0, metrics=metrics, max_failed_steps=2) as (engine, execs):
            execs.append(engine_executor(engine, "ex", fault=reject))
            while not engine.slots:
                await asyncio.sleep(0.01)
            slot = engine.slots["ex"]
            for i in range(4):  # twice --max-failed-steps, one at a time
                with pytest.raises(EngineError) as raised:
                    await collect(engine, req(f"b{i}", [3 + i, 4, 5]))
                assert raised.value.kind is ErrorKind.INVALID
                assert str(raised.value) == "structured outputs: the grammar does not compile here: x"
            assert slot.conn.state == "ready" and slot.failed_steps == 0
            execs[0].runner.serve = True
            assert len((await collect(engine, req("ok", [3, 4, 5], 4)))[0][0]) == 4
            await settle(engine)
        ends_once(metrics)

    run(main())


# ---------------------------------------------------------------- a result that breaks the contract

def test_a_contract_breaking_result_drops_its_executor_before_anything_of_it_is_applied(tokenizer):
    reqs = workload(victim=None)
    ref = reference(tokenizer, reqs)
    poisoned = []

    def out_of_vocabulary(plan, res, runner):
        if res is None or poisoned or len(res.sampled_token_ids) < 2 or runner.__dict__.get("steps", 0) < 20:
            runner.__dict__["steps"] = runner.__dict__.get("steps", 0) + 1
            return None
        poisoned.append(res.sampled_seq_ids[0])
        return wire.StepResult(res.step_id, res.sampled_seq_ids, [2**31 - 1] + res.sampled_token_ids[1:])

    async def main():
        metrics = Metrics()
        async with running(tokenizer, 1, metrics=metrics) as (engine, execs):
            execs.append(engine_executor(engine, "faulty", step_s=0.002, fault=out_of_vocabulary))
            while len(engine.slots) < 2:
                await asyncio.sleep(0.01)
            outs = await arrive(engine, reqs)
            assert poisoned, "the fault never fired"
            assert_bystanders_unharmed(outs, ref, None)  # the requests on "faulty" moved, unharmed
            assert engine.stats().num_migrations > 0
            await settle(engine)
        ends_once(metrics)

    run(main())


# ---------------------------------------------------------------- migration to a shorter context

def test_a_request_no_survivor_can_hold_fails_at_once_and_the_rest_migrate(tokenizer):
    short_ctx = 48
    long_reqs = [req(f"long{i}", [3 + i] + list(range(5, 25)), 60) for i in range(3)]  # 81 tokens at most
    short_reqs = [req(f"short{i}", [30 + i] + list(range(5, 15)), 20) for i in range(6)]  # 31 at most
    ref = reference(tokenizer, short_reqs)

    async def main():
        metrics = Metrics()
        async with running(tokenizer, 0, metrics=metrics) as (engine, execs):
            execs.append(engine_executor(engine, "long", step_s=0.01, max_model_len=1024))
            execs.append(engine_executor(engine, "short", step_s=0.01, max_model_len=short_ctx))
            while len(engine.slots) < 2:
                await asyncio.sleep(0.01)

            async def one(r):
                try:
                    return (await collect(engine, r))[0], time.monotonic()
                except EngineError as exc:
                    return exc, time.monotonic()

            tasks = {r.request_id: asyncio.create_task(one(r)) for r in long_reqs + short_reqs}
            while engine.slots["long"].scheduler.num_running < len(long_reqs):
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.2)  # the long requests are longer than the short context by now... or soon
            killed_at = time.monotonic()
            execs[0].kill()
            outs = {rid: await t for rid, t in tasks.items()}
            for r in long_reqs:
                out, ended_at = outs[r.request_id]
                assert isinstance(out, EngineError) and out.kind is ErrorKind.NO_EXECUTOR and "max_model_len is 48" in str(out)
                assert ended_at - killed_at < 5  # at once: the executor's death is noticed within ~1 s
            for r in short_reqs:
                assert outs[r.request_id][0] == ref[r.request_id]
            await settle(engine)
        ends_once(metrics)

    run(main())


def test_a_request_whose_executors_all_died_fails_after_the_orphan_timeout(tokenizer):
    async def main():
        metrics = Metrics()
        async with running(tokenizer, 1, metrics=metrics, orphan_timeout_s=0.5) as (engine, execs):
            task = asyncio.create_task(collect(engine, req("alone", [3, 4, 5, 6], 500)))
            while not engine.slots["fake0"].scheduler.num_running:
                await asyncio.sleep(0.005)
            execs[0].kill()
            with pytest.raises(EngineError, match="--orphan-timeout") as raised:
                await asyncio.wait_for(task, 10)
            assert raised.value.kind is ErrorKind.NO_EXECUTOR
        ends_once(metrics)

    run(main())


# ---------------------------------------------------------------- an abort racing a result

@pytest.mark.parametrize("async_scheduling,stop", [(True, ["never seen"]), (True, []), (False, [])],
                         ids=["async-stop-strings", "async", "sequential"])
def test_an_abort_racing_the_last_result_ends_the_request_once(tokenizer, async_scheduling, stop):
    """Each consumer stops right after its second-to-last token, while the step that samples its
    last one is in flight: the abort and the finishing result race, and the request must end once
    (requests with stop strings are streamed as soon as a result is applied, as are all of them
    with sequential scheduling: that is where the race was)."""
    async def main():
        metrics = Metrics()
        async with running(tokenizer, 0, metrics=metrics, async_scheduling=async_scheduling) as (engine, execs):
            execs.append(engine_executor(engine, "ex", step_s=0.01))
            while not engine.slots:
                await asyncio.sleep(0.01)

            async def stop_before_the_end(i):
                gen = engine.generate(req(f"a{i}", [3 + i, 4, 5, 6], 6, stop=stop))
                got = 0
                async for out in gen:
                    got += sum(len(c.token_ids) for c in out.choices)
                    if got >= 5:
                        break
                await gen.aclose()

            for i in range(0, 20, 4):
                await asyncio.gather(*(stop_before_the_end(j) for j in range(i, i + 4)))
            await settle(engine)
            assert not engine.tracked
        value = metrics.registry.get_sample_value
        assert value("pagedserve:request_success_total", {"finished_reason": "aborted"}) == 20
        assert value("pagedserve:request_success_total", {"finished_reason": "length"}) is None
        ends_once(metrics)

    run(main())
