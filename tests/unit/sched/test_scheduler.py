"""Scheduler against the strict fake executor: outputs, preemption, budgets, caching, aborts.

Every test checks integrity after every step (``drive``), and every request's
tokens are compared with an oracle that runs the fake model directly — so a
scheduler bug that changes what a sequence sees (a lost token after
preemption, a wrong block after swap, a bad prefix hit) changes its output.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve import wire
from pagedserve.engine_api import FinishReason, GenerationRequest, RequestParams
from pagedserve.wire import SamplingParams, StepResult
from scheduler_svc.sched.kv_cache_manager import KVCacheManager
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from scheduler_svc.sched.step_output import OutputProcessor
from testing import fake_executor
from testing.fake_executor import FakeExecutor, drive, sample_token

BS = 4
EOS = 3
VOCAB = 64


@pytest.fixture(autouse=True, params=[1, 2], ids=["sync", "async"])
def plan_depth(request, monkeypatch):
    """Every scenario runs twice: plan, run, update (sync), and with the next plan built
    while one is in flight (async scheduling); outputs must be the same."""
    monkeypatch.setattr(fake_executor, "DEFAULT_DEPTH", request.param)
    return request.param



def make(nblocks: int, ncpu: int = 0, mode: str = "recompute", seqs: int = 8, tokens: int = 32,
         max_len: int = 256, caching: bool = True, watermark: float = 0.0):
    cfg = SchedulerConfig(block_size=BS, max_num_seqs=seqs, max_num_batched_tokens=tokens,
                          max_model_len=max_len, preemption_mode=mode, watermark=watermark,
                          enable_prefix_caching=caching)
    sched = Scheduler(cfg, nblocks, ncpu, eos_token_ids=(EOS,))
    return sched, FakeExecutor(nblocks, ncpu, BS, VOCAB, check=sched.check_integrity)


def req(rid: str, prompt: list[int], max_tokens: int = 12, seed: int | None = None, **kw) -> GenerationRequest:
    sp = SamplingParams(seed=seed, want_logprobs=kw.pop("want_logprobs", False))
    return GenerationRequest(rid, prompt, RequestParams(max_tokens=max_tokens, sampling=sp, **kw))


def oracle(r: GenerationRequest, choice: int = 0, max_len: int = 256) -> list[int]:
    """What the fake model generates for choice ``choice`` of ``r``, run alone."""
    p = r.params
    seed = None if p.sampling.seed is None else p.sampling.seed + choice
    toks, out = list(r.prompt_token_ids), []
    while True:
        t = sample_token(toks, seed, VOCAB)
        toks.append(t)
        out.append(t)
        if (t == EOS and not p.ignore_eos) or t in p.stop_token_ids:
            return out
        if len(out) >= p.max_tokens or len(toks) >= max_len:
            return out


def workload(seed: int, count: int = 12, shared_prefix: bool = True) -> list[GenerationRequest]:
    rng = random.Random(seed)
    base = [rng.randrange(VOCAB) for _ in range(24)]
    out = []
    for i in range(count):
        own = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        prompt = (base[: rng.randint(0, 24)] if shared_prefix else []) + own
        out.append(req(f"r{i}", prompt, max_tokens=rng.randint(1, 24), seed=i))
    return out


def run_all(sched, ex, reqs, on_step=None):
    for r in reqs:
        sched.add_request(r)
    return drive(sched, ex, on_step=on_step)


def assert_all_released(sched, ex):
    stats = sched.block_stats()
    assert stats["used"] == 0 and stats["cpu_used"] == 0
    assert sched.num_free_blocks == sched.kv.num_device_blocks
    assert not ex.seqs, "the executor still holds sequences the scheduler forgot"
    assert not sched.has_work()


# --------------------------------------------------------------------------- outputs and preemption


def test_outputs_match_the_model_with_a_large_pool():
    reqs = workload(1)
    sched, ex = make(400)
    outs = run_all(sched, ex, reqs)
    assert sched.num_preemptions == 0
    for r in reqs:
        assert outs[(r.request_id, 0)] == oracle(r)
    assert_all_released(sched, ex)


@pytest.mark.parametrize("nblocks", [22, 30])
def test_recompute_preemption_gives_identical_outputs(nblocks):
    reqs = workload(2)
    sched, ex = make(nblocks)
    outs = run_all(sched, ex, reqs)
    assert sched.num_preemptions > 0
    for r in reqs:
        assert outs[(r.request_id, 0)] == oracle(r)
    assert_all_released(sched, ex)


@pytest.mark.parametrize("caching", [False, True], ids=["no-prefix-cache", "prefix-cache"])
def test_a_pool_too_small_for_its_requests_does_not_thrash(caching):
    """Four requests whose prompts fill the pool and that grow past it: one is preempted and waits
    until it fits whole, rather than coming back on its first chunk and being preempted again the
    moment the others grow (benchmarks/preemption_recompute.py measures what that cost)."""
    prompt_len, max_tokens = 60, 40
    reqs = [req(f"r{i}", [(i * 31 + j * 7) % 60 + 4 for j in range(prompt_len)], max_tokens=max_tokens,
                ignore_eos=True) for i in range(4)]
    sched, ex = make(58, seqs=8, tokens=16, caching=caching)  # 232 slots for 4 x 100 tokens
    outs = run_all(sched, ex, reqs)
    for r in reqs:
        assert outs[(r.request_id, 0)] == oracle(r)
    assert 0 < sched.num_preemptions <= 2
    assert ex.tokens_computed <= 1.5 * len(reqs) * (prompt_len + max_tokens)
    assert_all_released(sched, ex)


def test_swap_preemption_gives_identical_outputs():
    reqs = workload(3)
    sched, ex = make(22, ncpu=64, mode="swap")
    seen = {"out": 0, "in": 0, "cpu_peak": 0}

    def watch(plan, _):
        seen["out"] += len(plan.swap_out)
        seen["in"] += len(plan.swap_in)
        seen["cpu_peak"] = max(seen["cpu_peak"], sched.block_stats()["cpu_used"])

    outs = run_all(sched, ex, reqs, watch)
    assert sched.num_preemptions > 0 and seen["out"] > 0 and seen["in"] == seen["out"]
    assert seen["cpu_peak"] > 0
    for r in reqs:
        assert outs[(r.request_id, 0)] == oracle(r)
    assert_all_released(sched, ex)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_a_request_preempted_with_its_sample_in_flight_keeps_that_token(mode, monkeypatch):
    """Async scheduling: the victim's last step is still running when the next plan preempts it.
    The token it samples is real output (appended when the result comes), and the request is only
    re-admitted (or swapped in) after that."""
    reqs = workload(2) + workload(3)
    for i, r in enumerate(reqs):
        r.request_id = f"r{i}"
    sched, ex = make(22, ncpu=64 if mode == "swap" else 0, mode=mode)
    in_flight_victims = []
    preempt = Scheduler._preempt

    def watch(self, r, plan):
        in_flight_victims.extend(s.seq_id for s in r.live if s.num_placeholders)
        preempt(self, r, plan)

    monkeypatch.setattr(Scheduler, "_preempt", watch)
    for r in reqs:
        sched.add_request(r)
    outs = drive(sched, ex, depth=2)
    assert in_flight_victims, "the scenario never preempted a request with a sample in flight"
    for r in reqs:
        assert outs[(r.request_id, 0)] == oracle(r)
    assert_all_released(sched, ex)


def test_swap_mode_falls_back_to_recompute_without_cpu_room():
    reqs = workload(4)
    sched, ex = make(22, ncpu=0, mode="swap")
    outs = run_all(sched, ex, reqs, lambda plan, _: plan.swap_out == [] or pytest.fail("swapped"))
    assert sched.num_preemptions > 0
    assert all(outs[(r.request_id, 0)] == oracle(r) for r in reqs)
    assert_all_released(sched, ex)


def test_latest_arrival_is_preempted_first():
    sched, ex = make(10, seqs=4)
    reqs = [req(f"r{i}", [10 + i] * 7, max_tokens=12, ignore_eos=True) for i in range(3)]
    for r in reqs:
        sched.add_request(r)
    checked = 0
    while sched.has_work():
        before = [r.request_id for r in sched.running]
        plan = sched.schedule()
        waiting = {r.request_id for r in sched.waiting}
        preempted = [rid for rid in before if rid in waiting]
        if preempted:
            assert preempted == before[len(before) - len(preempted):]  # a suffix: the latest arrivals
            checked += 1
        sched.update(ex.run(plan))
        sched.check_integrity()
    assert sched.num_preemptions > 0 and checked > 0


# --------------------------------------------------------------------------- budgets


def test_chunked_prefill_respects_token_and_sequence_budgets():
    rng = random.Random(5)
    reqs = [req(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(30, 90))], seed=i)
            for i in range(6)]
    sched, ex = make(200, seqs=3, tokens=16)
    chunks = []

    def watch(plan, _):
        assert sum(plan.num_new_tokens) <= 16 and len(plan.scheduled_seq_ids) <= 3
        chunks.extend(n for n in plan.num_new_tokens if n > 1)

    outs = run_all(sched, ex, reqs, watch)
    assert max(chunks) == 16 and any(1 < n < 16 for n in chunks)  # long prompts were split
    assert all(outs[(r.request_id, 0)] == oracle(r) for r in reqs)
    assert_all_released(sched, ex)


def test_decode_continues_while_a_long_prompt_prefills():
    sched, ex = make(200, tokens=8)
    sched.add_request(req("short", [1, 2], max_tokens=10, ignore_eos=True))
    sched.update(ex.run(sched.schedule()))
    sched.add_request(req("long", list(range(5, 45)), max_tokens=2))
    plan = sched.schedule()
    by_id = dict(zip(plan.scheduled_seq_ids, plan.num_new_tokens, strict=True))
    assert sorted(by_id.values()) == [1, 7]  # one decode token + a 7-token chunk
    sched.update(ex.run(plan))
    drive(sched, ex)


def test_watermark_keeps_blocks_free_at_admission():
    sched, ex = make(16, watermark=0.25, tokens=64)  # keep 4 blocks free
    for i in range(6):
        sched.add_request(req(f"r{i}", [i] * 9, max_tokens=2, ignore_eos=True))
    plan = sched.schedule()
    assert len(plan.new_seqs) == 4  # 3 blocks each; a 5th would leave 16 - 15 = 1 < 4
    assert sched.num_free_blocks >= 4
    sched.update(ex.run(plan))
    drive(sched, ex)
    assert_all_released(sched, ex)


# --------------------------------------------------------------------------- prefix caching


def test_prefix_cache_hit_skips_computing_the_shared_prompt():
    sched, ex = make(64)
    prompt = list(range(20, 60))  # 40 tokens = 10 full blocks
    a = req("a", prompt, max_tokens=3, ignore_eos=True)
    drive_outs = run_all(sched, ex, [a])
    computed_a = ex.tokens_computed
    assert sched.prefix_cache_query_tokens == 40  # its prompt's tokens, none of its samples in flight
    b = req("b", prompt + [7, 8], max_tokens=3, seed=9)
    sched.add_request(b)
    cached = []
    outs = drive(sched, ex, on_step=lambda _, ups: cached.extend(u.num_cached_prompt_tokens for u in ups))
    assert sched.prefix_cache_hit_tokens == 40 and sched.prefix_cache_query_tokens == 40 + 42
    assert cached and set(cached) == {40}
    assert ex.tokens_computed - computed_a == 2 + 2  # 2 new prompt tokens + 2 decode steps
    assert outs[("b", 0)] == oracle(b) and drive_outs[("a", 0)] == oracle(a)
    assert sched.block_stats()["cached"] > 0
    assert_all_released(sched, ex)


def test_full_prompt_hit_still_computes_the_last_token():
    sched, ex = make(64)
    prompt = list(range(20, 36))  # 4 full blocks
    run_all(sched, ex, [req("a", prompt, max_tokens=1)])
    before = ex.tokens_computed
    b = req("b", prompt, max_tokens=2, seed=4)
    outs = run_all(sched, ex, [b])
    assert ex.tokens_computed - before == 4 + 1  # last block recomputed (12 hit), then one decode
    assert outs[("b", 0)] == oracle(b)


def test_prefix_caching_can_be_disabled():
    sched, ex = make(64, caching=False)
    prompt = list(range(20, 60))
    run_all(sched, ex, [req("a", prompt, max_tokens=2), req("b", prompt, max_tokens=2)])
    run_all(sched, ex, [req("c", prompt, max_tokens=2)])
    assert sched.prefix_cache_hit_tokens == 0 and sched.block_stats()["cached"] == 0


# --------------------------------------------------------------------------- stop rules and finishing


def test_stop_reasons_and_usage():
    sched, ex = make(64)
    base = req("x", [5, 6, 7], max_tokens=30, seed=1, ignore_eos=True)
    ref = oracle(base)
    stop_tok = ref[2]
    cases = {
        "len": req("len", [5, 6, 7], max_tokens=4, seed=1, ignore_eos=True),
        "stop": req("stop", [5, 6, 7], max_tokens=30, seed=1, ignore_eos=True, stop_token_ids=[stop_tok]),
    }
    finals = {}

    def watch(_, ups):
        for u in ups:
            if u.finished:
                finals[u.request_id] = (u.seqs[-1].finish_reason, u.prompt_tokens)

    outs = run_all(sched, ex, list(cases.values()), watch)
    assert finals["len"] == (FinishReason.LENGTH, 3) and outs[("len", 0)] == ref[:4]
    assert finals["stop"][0] == FinishReason.STOP and outs[("stop", 0)] == ref[: ref.index(stop_tok) + 1]


def test_eos_stops_unless_ignored():
    rng = random.Random(11)
    for _ in range(200):  # find a prompt whose continuation hits EOS early
        prompt = [rng.randrange(VOCAB) for _ in range(5)]
        ref = oracle(req("p", prompt, max_tokens=40, seed=0, ignore_eos=True))
        if EOS in ref[:30]:
            break
    sched, ex = make(64)
    a = req("a", prompt, max_tokens=40, seed=0)
    b = req("b", prompt, max_tokens=40, seed=0, ignore_eos=True)
    reasons = {}
    outs = run_all(sched, ex, [a, b], lambda _, ups: reasons.update(
        {u.request_id: u.seqs[-1].finish_reason for u in ups if u.finished}))
    assert outs[("a", 0)] == ref[: ref.index(EOS) + 1] and reasons["a"] == FinishReason.EOS
    assert outs[("b", 0)] == ref and reasons["b"] == FinishReason.LENGTH


def test_finish_sequence_releases_at_once():
    sched, ex = make(64)
    sched.add_request(req("a", [1, 2, 3, 4, 5], max_tokens=50, ignore_eos=True))
    for _ in range(3):
        sched.update(ex.run(sched.schedule()))
    assert sched.finish_sequence("a", 0, FinishReason.STOP) is True
    assert sched.block_stats()["used"] == 0 and sched.has_work()
    plan = sched.schedule()
    assert plan.free_seq_ids and not plan.scheduled_seq_ids
    sched.update(ex.run(plan))
    assert sched.schedule() is None
    assert_all_released(sched, ex)
    assert sched.finish_sequence("a", 0, FinishReason.STOP) is True  # unknown: idempotent


def test_logprobs_are_passed_through():
    sched, ex = make(64)
    seen = []
    run_all(sched, ex, [req("a", [1, 2], max_tokens=3, want_logprobs=True)],
            lambda _, ups: seen.extend(su.logprobs for u in ups for su in u.seqs))
    assert len(seen) == 3 and all(len(lp) == 1 and lp[0].logprob <= 0 for lp in seen)


# --------------------------------------------------------------------------- aborts, errors, migration


def test_abort_running_waiting_and_swapped_requests():
    sched, ex = make(22, ncpu=64, mode="swap", seqs=8)
    reqs = workload(6, count=10)
    for r in reqs:
        sched.add_request(r)
    aborted: set[str] = set()
    for step in range(400):
        if not sched.has_work():
            break
        plan = sched.schedule()
        if plan is None:
            break
        res = ex.run(plan)
        if step == 3 and sched.running:  # abort between schedule and update: results are dropped
            rid = sched.running[0].request_id
            sched.abort_request(rid)
            aborted.add(rid)
        sched.update(res)
        sched.check_integrity()
        for q in (sched.swapped, sched.waiting):
            if q and len(aborted) < 4:
                rid = q[-1].request_id
                sched.abort_request(rid)
                sched.abort_request(rid)  # idempotent
                aborted.add(rid)
                sched.check_integrity()
    assert len(aborted) >= 3
    assert_all_released(sched, ex)


def test_abort_frees_blocks_now_and_tells_the_executor_next():
    sched, ex = make(64)
    sched.add_request(req("a", list(range(10)), max_tokens=20, ignore_eos=True))
    sched.update(ex.run(sched.schedule()))
    sid = sched.requests["a"].live[0].seq_id
    sched.abort_request("a")
    assert sched.block_stats()["used"] == 0
    plan = sched.schedule()
    assert plan.free_seq_ids == [sid] and not plan.scheduled_seq_ids
    sched.update(ex.run(plan))
    assert sched.schedule() is None and not ex.seqs


def test_a_failed_step_fails_the_requests_it_could_not_serve_and_no_other():
    sched, ex = make(64)
    sched.add_request(req("a", [1, 2, 3], max_tokens=5))
    sched.add_request(req("b", [4, 5, 6], max_tokens=5))
    plan = sched.schedule()
    a, b = plan.scheduled_seq_ids
    ups = sched.update(StepResult(plan.step_id, [b], [7], failed_seq_ids=[a], error="CUDA error: detail"))
    assert [(u.request_id, u.finished, u.error) for u in ups] == [
        ("b", False, None), ("a", True, "the executor failed its step")]  # the detail stays in the log
    assert list(sched.requests) == ["b"]
    sched.check_integrity()


def test_update_checks_the_result_answers_the_oldest_plan():
    sched, ex = make(64)
    sched.add_request(req("a", [1, 2, 3], max_tokens=5))
    sched.add_request(req("b", [4, 5, 6], max_tokens=5))
    first = sched.schedule()
    second = sched.schedule()  # planned ahead: each sequence computes its placeholder
    assert second.scheduled_seq_ids == first.scheduled_seq_ids and second.num_new_tokens == [1, 1]
    with pytest.raises(ValueError, match="oldest plan in flight is"):
        sched.update(StepResult(second.step_id, list(second.scheduled_seq_ids), [7, 7]))
    a, b = first.scheduled_seq_ids
    with pytest.raises(ValueError, match="samples 1 sequences, its plan 2"):
        sched.update(StepResult(first.step_id, [a], [7]))
    with pytest.raises(ValueError, match=f"samples seq {b} where its plan has {a}"):
        sched.update(StepResult(first.step_id, [b, a], [7, 7]))


def test_take_all_requests_and_resume_elsewhere():
    reqs = workload(7, count=6)
    sched, ex = make(64)
    for r in reqs:
        sched.add_request(r)
    partial: dict[tuple[str, int], list[int]] = {}
    for _ in range(6):
        for u in sched.update(ex.run(sched.schedule())):
            for su in u.seqs:
                partial.setdefault((u.request_id, su.index), []).extend(su.new_token_ids)
    sched.schedule()  # a plan in flight when the executor dies
    taken = sched.take_all_requests()
    assert [m.request.request_id for m in taken] == [r.request_id for r in reqs if r.request_id in
                                                     {m.request.request_id for m in taken}]
    assert sched.block_stats()["used"] == 0 and not sched.requests
    assert sched.update(StepResult(sched._step_id)) == []  # the lost plan's result is ignored
    other, ex2 = make(64)
    for m in taken:
        assert m.outputs[0] == partial.get((m.request.request_id, 0), [])
        other.add_request(m.request, resume=m)
    rest = drive(other, ex2)
    for m in taken:
        rid = m.request.request_id
        assert m.outputs[0] + rest.get((rid, 0), []) == oracle(m.request)
    assert_all_released(other, ex2)


# --------------------------------------------------------------------------- the wire


def test_decode_plans_are_small_deltas():
    sched, ex = make(400, seqs=32, tokens=512)
    for i in range(32):
        sched.add_request(req(f"r{i}", list(range(i, i + 20)), max_tokens=40, ignore_eos=True))
    for _ in range(3):
        sched.update(ex.run(sched.schedule()))
    sizes = []
    for _ in range(8):
        plan = sched.schedule()
        assert not plan.new_seqs and len(plan.scheduled_seq_ids) == 32
        sizes.append(len(wire.encode(plan)) / 32)
        sched.update(ex.run(plan))
    assert max(sizes) <= 12


def test_idle_scheduler_returns_none():
    sched, _ = make(16)
    assert sched.schedule() is None and not sched.has_work()


def test_invalid_requests_are_rejected():
    sched, _ = make(8, max_len=64)
    with pytest.raises(ValueError, match="empty"):
        sched.add_request(req("a", []))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(req("a", [1] * 64))
    with pytest.raises(ValueError, match="KV blocks"):
        sched.add_request(req("a", [1] * 40, max_tokens=30))
    sched.add_request(req("a", [1]))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(req("a", [1]))


def test_counters_track_blocks_and_queues():
    sched, ex = make(64, ncpu=8)
    sched.add_request(req("a", list(range(9)), max_tokens=5, ignore_eos=True))
    sched.add_request(req("b", [1], max_tokens=5, n=2, seed=1, ignore_eos=True))
    assert (sched.num_waiting, sched.num_running, sched.num_swapped) == (2, 0, 0)
    sched.update(ex.run(sched.schedule()))
    assert (sched.num_waiting, sched.num_running) == (0, 2)
    assert sched.num_used_blocks == 3 + 2 and sched.num_shared_blocks == 0  # 1-token prompt: 2 own blocks
    assert sched.num_free_blocks == 64 - sched.num_used_blocks and sched.num_cpu_used_blocks == 0
    drive(sched, ex)
    assert sched.num_used_blocks == 0 and sched.num_cached_blocks >= 3  # at least a's 3 full blocks


@pytest.mark.parametrize("field,value", [("block_size", 0), ("max_num_seqs", -1), ("max_model_len", 1.5),
                                         ("preemption_mode", "drop"), ("watermark", 1.0)])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        SchedulerConfig(**{field: value})


# --------------------------------------------------------------------------- random configurations

_req_st = st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=20),  # small alphabet: shared prefixes
                    st.integers(1, 3), st.integers(1, 16), st.integers(0, 999))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(nblocks=st.integers(12, 32), ncpu=st.sampled_from([0, 32]), mode=st.sampled_from(["recompute", "swap"]),
       tokens=st.integers(4, 40), seqs=st.integers(3, 12), watermark=st.sampled_from([0.0, 0.1]),
       caching=st.booleans(), reqs=st.lists(_req_st, min_size=3, max_size=10),
       abort_at=st.lists(st.tuples(st.integers(0, 30), st.integers(0, 7)), max_size=3))
def test_random_configurations_keep_outputs_and_release_everything(
        nblocks, ncpu, mode, tokens, seqs, watermark, caching, reqs, abort_at):
    sched, ex = make(nblocks, ncpu, mode, seqs=seqs, tokens=tokens, watermark=watermark, caching=caching)
    accepted = []
    for i, (prompt, n, max_tokens, seed) in enumerate(reqs):
        r = req(f"r{i}", prompt, max_tokens=max_tokens, seed=seed, n=n)
        try:
            sched.add_request(r)
            accepted.append(r)
        except ValueError:
            assert n > min(seqs, tokens) or n * -(-(len(prompt) + max_tokens) // BS) > nblocks - int(watermark * nblocks)
    aborted: set[str] = set()
    step = 0

    def on_step(plan, ups):
        nonlocal step
        for when, which in abort_at:
            if when == step and which < len(accepted):
                sched.abort_request(accepted[which].request_id)
                aborted.add(accepted[which].request_id)
        step += 1

    outs = drive(sched, ex, on_step=on_step)
    for r in accepted:
        if r.request_id not in aborted:
            for i in range(r.params.n):
                assert outs.get((r.request_id, i), []) == oracle(r, i), (r.request_id, i)
    assert_all_released(sched, ex)


def test_every_end_of_sequence_id_stops_generation():
    """Llama 3.1 Instruct lists three EOS ids; a chat turn ends at the last (<|eot_id|>), not the first."""
    cfg = SchedulerConfig(block_size=BS, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    sched = Scheduler(cfg, 32, 0, eos_token_ids=(EOS, 60, 61))
    sched.add_request(req("chat", [5, 6, 7], max_tokens=10))
    sched.add_request(req("raw", [5, 6, 8], max_tokens=10, ignore_eos=True))
    plan = sched.schedule()
    ids = plan.scheduled_seq_ids
    updates = {u.request_id: u for u in sched.update(StepResult(plan.step_id, list(ids), [61] * len(ids)))}
    assert updates["chat"].finished and updates["chat"].seqs[0].finish_reason == FinishReason.EOS
    assert not updates["raw"].finished  # ignore_eos ignores every EOS id
    sched.abort_request("raw")
    sched.check_integrity()
    assert sched.block_stats()["used"] == 0


def test_eos_ids_come_from_config_and_generation_config(tmp_path):
    from scheduler_svc.__main__ import eos_token_ids

    (tmp_path / "config.json").write_text('{"eos_token_id": 128001}')
    assert eos_token_ids(tmp_path) == (128001,)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [128001, 128008, 128009]}')
    assert eos_token_ids(tmp_path) == (128001, 128008, 128009)
    (tmp_path / "config.json").write_text('{"eos_token_id": null}')
    assert eos_token_ids(tmp_path) == (128001, 128008, 128009)


@pytest.mark.parametrize("where", ["_group_work", "_take_prefix_hits", "finish", "allocate"])
def test_an_exception_while_handling_one_request_fails_it_alone(where, monkeypatch, caplog):
    """A bug hit by one request (while admitting, scheduling, decoding or finishing it) fails
    that request; every other request runs to its oracle output and no block leaks."""
    reqs = workload(5, count=8)
    victim = reqs[3].request_id
    owner = {"finish": OutputProcessor, "allocate": KVCacheManager}.get(where, Scheduler)
    original = getattr(owner, where)

    def flaky(self, r, *args):
        rid = r.request.request_id if where in ("finish", "allocate") else r.request_id
        decoding = where != "allocate" or r.num_computed_tokens >= r.num_prompt_tokens
        if rid == victim and decoding:
            raise ZeroDivisionError("a bug that only this request hits")
        return original(self, r, *args)

    monkeypatch.setattr(owner, where, flaky)
    sched, ex = make(64)
    failed = []
    outs = run_all(sched, ex, reqs, on_step=lambda plan, ups: failed.extend(
        u for u in ups + sched.failures if u.error))
    sched.failures.clear()
    errors = {u.request_id: u.error for u in failed}
    assert errors == {victim: "internal error while scheduling it"}  # what its client sees
    assert "a bug that only this request hits" in caplog.text  # the detail, in the log
    for r in reqs:
        if r.request_id != victim:
            assert outs[(r.request_id, 0)] == oracle(r)
    assert_all_released(sched, ex)


def test_a_request_that_cannot_fit_yet_does_not_take_its_prefix_hits_every_step(monkeypatch):
    """The head of the queue is retried every step while blocks are short. Taking its cached
    prefix blocks and handing them back each time cost two refcount changes per hit block per
    step (milliseconds for a preempted long request); it is now refused before touching them,
    and admitted with the same hits once it fits."""
    from scheduler_svc.sched.block_pool import BlockPool

    sched, ex = make(40, tokens=32, seqs=4)
    shared = [10 + i % 50 for i in range(60)]
    run_all(sched, ex, [req("first", shared, max_tokens=1)])  # its 15 prompt blocks stay cached
    hog = req("hog", [5] * 100, max_tokens=40)  # 25 to 35 of the 40 blocks
    late = req("late", shared + [7] * 40, max_tokens=4)
    touched: list[int] = []
    real = BlockPool.touch
    monkeypatch.setattr(BlockPool, "touch", lambda self, b: touched.append(b.block_id) or real(self, b))
    waiting: list[int] = []
    outs = run_all(sched, ex, [hog, late], on_step=lambda plan, ups: waiting.append(sched.num_waiting))
    assert waiting.count(1) >= 10, "precondition: late waited for blocks while hog ran"
    assert len(touched) <= 15  # its hits, taken once
    assert outs[("late", 0)] == oracle(late) and outs[("hog", 0)] == oracle(hog)
    assert sched.prefix_cache_hit_tokens >= 4  # it still started from cached blocks
    assert_all_released(sched, ex)


def test_choices_of_a_seed_near_the_top_wrap_around_64_bits():
    from scheduler_svc.sched.lifecycle import seeded

    sp = SamplingParams(temperature=1.0, seed=2**64 - 2)
    assert [seeded(sp, i).seed for i in range(4)] == [2**64 - 2, 2**64 - 1, 0, 1]
