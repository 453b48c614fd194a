"""The engine with in-process executors: the real ZeroMQ worker around the fake executor.

Fast (no model, no subprocesses) and strict: the fake executor checks every
plan against the KV state it simulates, and every scenario ends with each
scheduler's check_integrity() and no block held.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from tokenizers import Tokenizer

from pagedserve.engine_api import (
    EngineError,
    ErrorKind,
    FinishReason,
    GenerationRequest,
    RequestParams,
)
from pagedserve.wire import SamplingParams
from scheduler_svc.engine.engine_config import EngineConfig
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing.fake_engine import collect as _collect
from testing.fake_engine import engine_executor, running
from testing.fake_engine import req as _req
from testing.fake_engine import run as _run
from testing.fake_engine import settle as _settle
from testing.grpc_fakes import make_tokenizer
from testing.in_process_engine import Engine


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return make_tokenizer()


def test_streams_tokens_and_frees_every_block(tokenizer):
    async def main():
        async with running(tokenizer, 1) as (engine, execs):
            outs = await asyncio.gather(*(_collect(engine, _req(f"r{i}", list(range(3, 30 + i)), 10))
                                          for i in range(12)))
            for tokens, text, finish, usage in outs:
                assert len(tokens[0]) == 10 and finish[0] == FinishReason.LENGTH
                assert text[0] == tokenizer.decode(tokens[0])
                assert usage.completion_tokens == 10
            await _settle(engine)

    _run(main())


def test_stop_string_ends_the_choice_without_the_stop_text(tokenizer):
    async def main():
        async with running(tokenizer, 1) as (engine, execs):
            tokens, text, _, _ = await _collect(engine, _req("free", list(range(3, 20)), 24))
            stop = text[0][5:8]  # a piece of what this prompt deterministically produces
            assert stop
            _, text2, finish2, usage = await _collect(engine, _req("stopped", list(range(3, 20)), 24,
                                                                   stop=[stop]))
            assert finish2[0] == FinishReason.STOP
            assert text2[0] == text[0][:text[0].index(stop)]
            assert usage.completion_tokens < 24
            await _settle(engine)

    _run(main())


def test_closing_the_stream_aborts_and_frees(tokenizer):
    async def main():
        async with running(tokenizer, 1) as (engine, execs):
            gen = engine.generate(_req("gone", list(range(3, 40)), 200))
            got = 0
            async for out in gen:
                got += sum(len(c.token_ids) for c in out.choices)
                if got >= 3:
                    break
            await gen.aclose()
            assert "gone" not in engine.tracked
            await _settle(engine)

    _run(main())


def test_a_cancelled_consumer_aborts_its_request_and_frees_its_blocks(tokenizer):
    """A client disconnect as a consumer without aclose() sees it: its task is cancelled while it
    waits for a token and the stream is dropped. The request must not run on to max_tokens."""
    from scheduler_svc.telemetry.metrics import Metrics

    async def main():
        metrics = Metrics()
        async with running(tokenizer, 1, metrics=metrics) as (engine, execs):
            got = []

            async def consume():
                async for out in engine.generate(_req("left", list(range(3, 40)), 400)):
                    got.append(out)

            task = asyncio.ensure_future(consume())
            while len(got) < 3:
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            for _ in range(100):
                if "left" not in engine.tracked:
                    break
                await asyncio.sleep(0.01)
            assert "left" not in engine.tracked
            await _settle(engine)
            assert metrics.registry.get_sample_value("pagedserve:request_success_total",
                                                     {"finished_reason": "aborted"}) == 1

    _run(main())


def test_dead_executor_requests_continue_elsewhere_without_gap_or_repeat(tokenizer):
    async def main():
        async with running(tokenizer, 1) as (engine, execs):
            reqs = [_req(f"m{i}", [7 + i] + list(range(3, 25)), 40) for i in range(6)]
            reference = await asyncio.gather(*(_collect(engine, r) for r in reqs))
            execs.append(engine_executor(engine, "fake1"))
            while len(engine.slots) < 2:
                await asyncio.sleep(0.01)
            for r in reqs:
                r.request_id += "-again"
            tasks = [asyncio.create_task(_collect(engine, r)) for r in reqs]
            while sum(s.scheduler.num_running for s in engine.slots.values() if s.id == "fake0") == 0:
                await asyncio.sleep(0.005)
            execs[0].kill()
            outs = await asyncio.gather(*tasks)
            assert [o[0] for o in outs] == [r[0] for r in reference]
            assert [o[1] for o in outs] == [r[1] for r in reference]
            assert engine.stats().num_migrations > 0
            await _settle(engine)

    _run(main())


def test_a_drain_that_runs_out_of_time_moves_requests_without_a_gap(tokenizer):
    """At the end of a drain's grace period the requests move while a step's tokens are applied
    but not yet streamed: the stream must get them before the move, or it skips them."""
    async def main():
        async with running(tokenizer, 0) as (engine, execs):
            execs.append(engine_executor(engine, "draining", step_s=0.005, drain_timeout=1.0))
            while len(engine.slots) < 1:
                await asyncio.sleep(0.01)
            reqs = [_req(f"d{i}", [9 + i] + list(range(3, 20)), 250) for i in range(4)]
            reference = await asyncio.gather(*(_collect(engine, r) for r in reqs))
            for r in reqs:
                r.request_id += "-again"
            tasks = [asyncio.create_task(_collect(engine, r)) for r in reqs]
            await asyncio.sleep(0)  # all admitted (to the only executor) before the survivor joins
            execs.append(engine_executor(engine, "survivor"))
            while len(engine.slots) < 2 or engine.slots["draining"].scheduler.num_running < len(reqs):
                await asyncio.sleep(0.005)
            execs[0].worker.request_drain()  # grace 1 s: the requests move after ~0.6 s
            outs = await asyncio.gather(*tasks)
            assert engine.stats().num_migrations == len(reqs)
            assert [o[0] for o in outs] == [r[0] for r in reference]
            assert [o[1] for o in outs] == [r[1] for r in reference]
            await _settle(engine)

    _run(main())


def test_a_request_while_every_executor_drains_is_told_so(tokenizer):
    async def main():
        async with running(tokenizer, 0) as (engine, execs):
            execs.append(engine_executor(engine, "leaving", step_s=0.005, drain_timeout=5.0))
            while len(engine.slots) < 1:
                await asyncio.sleep(0.01)
            long = asyncio.create_task(_collect(engine, _req("long", list(range(3, 20)), 60)))
            while engine.slots["leaving"].scheduler.num_running < 1:
                await asyncio.sleep(0.005)
            execs[0].worker.request_drain()
            while engine.slots["leaving"].conn.state != "draining":
                await asyncio.sleep(0.005)
            with pytest.raises(EngineError) as raised:
                await _collect(engine, _req("late", [3, 4, 5], 4))
            assert str(raised.value) == ("the executors are all draining (1: each finishes its requests, then leaves); "
                                         "try again once another has registered")
            assert len((await long)[0][0]) == 60  # the drain lets it finish

    _run(main())


def test_loop_failure_fails_its_requests_and_the_executor_comes_back(tokenizer):
    async def main():
        async with running(tokenizer, 1) as (engine, execs):
            slot = engine.slots["fake0"]
            real_update = slot.scheduler.update

            def broken(result):
                raise RuntimeError("injected scheduler bug")

            slot.scheduler.update = broken
            with pytest.raises(EngineError) as raised:
                await _collect(engine, _req("victim", list(range(3, 20))))
            assert raised.value.kind is ErrorKind.FAILED
            slot.scheduler.update = real_update
            # The executor notices the silence, re-registers, and serving resumes.
            for _ in range(300):
                if engine.is_ready():
                    break
                await asyncio.sleep(0.02)
            tokens, _, _, _ = await _collect(engine, _req("after", list(range(3, 20)), 5))
            assert len(tokens[0]) == 5
            await _settle(engine)

    _run(main())


def test_queue_limit_and_no_executor(tokenizer):
    async def main():
        cfg = EngineConfig(scheduler=SchedulerConfig(), executor_endpoint="tcp://127.0.0.1:0")
        engine = Engine(cfg, tokenizer, eos_token_ids=())
        await engine.start()
        try:
            with pytest.raises(EngineError) as raised:
                await _collect(engine, _req("x", [3, 4, 5]))
            assert raised.value.kind is ErrorKind.NO_EXECUTOR
        finally:
            await engine.shutdown(0)
        one_seat = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256)
        async with running(tokenizer, 1, max_queued_requests=2, scheduler=one_seat) as (engine, execs):
            gens = [engine.generate(_req(f"q{i}", list(range(3, 300)), 50)) for i in range(3)]
            firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
            await asyncio.sleep(0)  # all admitted, none scheduled yet: one takes the seat, two queue
            assert engine.stats().num_waiting == 3
            with pytest.raises(EngineError) as raised:
                await _collect(engine, _req("over", list(range(3, 300))))
            assert raised.value.kind is ErrorKind.QUEUE_FULL
            await asyncio.gather(*firsts)
            for g in gens:
                await g.aclose()
            await _settle(engine)

    _run(main())


def test_a_burst_that_free_seats_take_is_not_refused_as_a_full_queue(tokenizer):
    """Requests admitted in one burst wait a loop turn before a step takes them: the seats free for
    them (max_num_seqs) are not a queue, and max_queued_requests counts only those beyond."""
    async def main():
        async with running(tokenizer, 1, max_queued_requests=4) as (engine, _):  # 16 seats
            outs = await asyncio.gather(*(_collect(engine, _req(f"b{i}", list(range(3, 20)), 5)) for i in range(16)))
            assert all(len(tokens[0]) == 5 for tokens, *_ in outs)
            gens = [engine.generate(_req(f"q{i}", list(range(3, 20)), 5)) for i in range(20)]
            firsts = [asyncio.ensure_future(g.__anext__()) for g in gens]
            await asyncio.sleep(0)  # 16 take the seats, 4 queue
            with pytest.raises(EngineError) as raised:
                await _collect(engine, _req("over", list(range(3, 20)), 5))
            assert raised.value.kind is ErrorKind.QUEUE_FULL
            assert "4 requests are queued, the limit (max_queued_requests) is 4" in str(raised.value)
            await asyncio.gather(*firsts)
            for g in gens:
                await g.aclose()
            await _settle(engine)

    _run(main())


def test_metrics_gauges_return_to_idle_after_the_work(tokenizer):
    from scheduler_svc.telemetry.metrics import Metrics

    async def main():
        metrics = Metrics()
        async with running(tokenizer, 1, metrics=metrics) as (engine, _):
            await asyncio.gather(*(_collect(engine, _req(f"g{i}", list(range(3, 40)), 30)) for i in range(6)))
            value = metrics.registry.get_sample_value
            deadline = time.monotonic() + 30
            while value("pagedserve:num_requests_running") or value("pagedserve:kv_cache_usage_perc",
                                                                     {"executor": "fake0"}):
                assert time.monotonic() < deadline, "the gauges did not return to idle"
                await asyncio.sleep(0.05)  # an idle loop turn refreshes the gauges
            assert value("pagedserve:num_requests_running") == 0
            assert value("pagedserve:generation_tokens_total") == 180
            # every token but each request's first has an inter-token latency, whichever path streamed it
            assert value("pagedserve:inter_token_latency_seconds_count") == 180 - 6
            assert value("pagedserve:time_to_first_token_seconds_count") == 6
            assert value("pagedserve:kv_cache_usage_perc", {"executor": "fake0"}) == 0
            assert value("pagedserve:request_queue_time_seconds_count") == 6  # once per request
            assert 0 < value("pagedserve:request_queue_time_seconds_sum") < 60

    _run(main())


def test_a_slow_executor_does_not_stall_the_others(tokenizer):
    async def main():
        async with running(tokenizer, 0) as (engine, execs):
            for name, step_s in (("slow", 0.5), ("fast", 0.0)):  # ties go to the first registered
                execs.append(engine_executor(engine, name, step_s))
                while name not in engine.slots:
                    await asyncio.sleep(0.01)
            slow = asyncio.create_task(_collect(engine, _req("on-slow", list(range(3, 20)), 6)))
            while not engine.slots["slow"].requests:  # routed to the idle (slow) executor
                await asyncio.sleep(0.005)
            t0 = time.monotonic()
            tokens, _, _, _ = await _collect(engine, _req("on-fast", list(range(40, 60)), 30))  # no shared prefix
            fast_s = time.monotonic() - t0
            assert len(tokens[0]) == 30
            assert fast_s < 1.5, f"30 fast steps took {fast_s:.2f}s next to a 0.5 s/step executor"
            assert not slow.done()
            await slow

    _run(main())


def test_a_consumer_that_falls_behind_gets_several_steps_at_once_without_a_token_changed(tokenizer, monkeypatch):
    """Slow consumers (a client holding its writes back) and a front that streams two updates
    between yields: messages carry several steps' tokens, with the same tokens, text, logprobs
    and usage as one by one."""
    import scheduler_svc.front.streams as front_streams

    reqs = [_req(f"g{i}", list(range(3, 20 + i)), 12) for i in range(5)]
    reqs += [GenerationRequest(f"n{i}", list(range(5, 25)), RequestParams(
        max_tokens=9, n=2, ignore_eos=True, sampling=SamplingParams(
            temperature=0.8, seed=7 + i, want_logprobs=True, logprobs=2))) for i in range(3)]

    async def collect_all(lagging: bool):
        if lagging:
            monkeypatch.setattr(front_streams, "CHUNK", 2)
        async with running(tokenizer, 1, async_scheduling=True) as (engine, execs):
            per_message, outs = [], []
            for r in reqs:
                r.request_id += "-lag" if lagging else ""

            async def one(req):
                text, toks, lps, usage = {}, {}, {}, None
                async for out in engine.generate(req):
                    for c in out.choices:
                        per_message.append(len(c.token_ids))
                        text[c.index] = text.get(c.index, "") + c.text
                        toks.setdefault(c.index, []).extend(c.token_ids)
                        lps.setdefault(c.index, []).extend((lp.token_id, lp.logprob) for lp in c.logprobs)
                    usage = out.usage or usage
                    if lagging:
                        await asyncio.sleep(0.02)
                return text, toks, lps, usage.completion_tokens

            outs = await asyncio.gather(*(one(r) for r in reqs))
            await _settle(engine)
            return outs, max(per_message)

    plain, most_plain = _run(collect_all(False))
    lagged, most_lagged = _run(collect_all(True))
    assert lagged == plain
    assert most_plain == 1 and most_lagged > 1  # merged only when the consumer fell behind


def test_a_prompt_is_hashed_once_by_its_front_and_the_core_hashes_only_what_it_computes(tokenizer, monkeypatch):
    """The prompt's block hashes (sha256 per block) are computed once, by the front: its chain is
    what the core's router and the scheduler's prefix lookup use. The core hashes only the blocks
    it computes, as it registers them (a front's hashes never name what the cache holds), never
    those a hit found."""
    from pagedserve import kv_blocks
    from scheduler_svc.engine import requests as core_requests
    from scheduler_svc.front import streams as front_streams
    from scheduler_svc.sched import kv_cache_manager

    hashed: dict[str, list[int]] = {"front": [], "core": []}

    def counting(side):
        def count(parent, toks, bs, extra=b""):
            hashed[side].append(len(toks) // bs)
            return real(parent, toks, bs, extra)
        return count

    real = kv_blocks.hash_blocks
    for module, side in ((kv_blocks, "core"), (kv_cache_manager, "core"), (core_requests, "core"),
                         (front_streams, "front")):  # every module that calls it
        monkeypatch.setattr(module, "hash_blocks", counting(side))

    async def main():
        async with running(tokenizer, 1) as (engine, _):
            tokens, _, _, _ = await _collect(engine, _req("h", list(range(100, 164)), 2))  # 4 full blocks
            assert len(tokens[0]) == 2
            await _settle(engine)
            first = sum(hashed["core"])
            again, _, _, usage = await _collect(engine, _req("h2", list(range(100, 164)), 2))
            assert usage.cached_prompt_tokens == 48  # the first request's blocks were cached under them
            await _settle(engine)
            return first

    first = _run(main())
    assert hashed["front"] == [4, 4]  # one chain per request, none at routing or admission
    assert first == 4  # the first request computed its 4 prompt blocks (its 2 tokens fill none)
    assert sum(hashed["core"]) - first == 1  # the second found 3 and computed the last


def test_an_executor_that_handshakes_again_keeps_its_old_schedulers_counters(tokenizer):
    """The same connection handshakes again (its process restarted): the new scheduler takes the
    slot at once, and what the old one counted (prefix lookups, preemptions, speculation) must stay
    in the engine's totals, or pagedserve:prefix_cache_queries_total and the like go back."""
    async def main():
        async with running(tokenizer, 1) as (engine, _):
            await asyncio.gather(*(_collect(engine, _req(f"c{i}", list(range(3, 40)), 4)) for i in range(3)))
            before = engine.stats()
            assert before.prefix_cache_query_tokens > 0
            old = engine.slots["fake0"]
            await engine.hub._handshake(old.conn.identity, old.conn.info)  # (as the restarted process would)
            assert engine.slots["fake0"] is not old
            await asyncio.wait_for(asyncio.shield(old.task), 5)
            after = engine.stats()
            assert (after.prefix_cache_query_tokens, after.prefix_cache_hit_tokens) == \
                (before.prefix_cache_query_tokens, before.prefix_cache_hit_tokens)

    _run(main())


def test_a_cache_salt_shares_prefix_blocks_only_among_requests_of_that_salt(tokenizer):
    """vLLM's cache_salt roots the block hash chain: the same prompt hits the cache under the same
    salt only; an unsalted request shares nothing with a salted one, and the outputs do not change."""
    prompt = list(range(100, 164))  # 4 full blocks: a hit finds 3 (the last token is computed)

    def salted(rid: str, salt: str | None) -> GenerationRequest:
        r = _req(rid, prompt, 2)
        r.cache_salt = salt
        return r

    async def main():
        hits = {}
        async with running(tokenizer, 1) as (engine, _):
            for rid, salt in (("a1", "tenant-a"), ("b1", "tenant-b"), ("plain1", None), ("a2", "tenant-a"),
                              ("b2", "tenant-b"), ("plain2", None)):
                tokens, _, _, usage = await _collect(engine, salted(rid, salt))
                hits[rid] = (usage.cached_prompt_tokens, tokens)
                await _settle(engine)
        return hits

    hits = _run(main())
    assert [hits[r][0] for r in ("a1", "b1", "plain1", "a2", "b2", "plain2")] == [0, 0, 0, 48, 48, 48]
    assert len({str(h[1]) for h in hits.values()}) == 1
