"""LoRA adapters in the scheduler: slots, pins, loads, the prefix cache per adapter, load failures.

Against the strict fake executor, whose model and KV fingerprints depend on each sequence's
adapter: a sequence run under the wrong adapter, a cached block shared across adapters, or an
adapter replaced under a live sequence changes its tokens or fails the plan. Integrity (queues,
blocks, slot pins) is checked after every step.
"""

from __future__ import annotations

import random

import pytest

from pagedserve.engine_api import ErrorKind, GenerationRequest, RequestParams
from pagedserve.kv_blocks import lora_key
from pagedserve.wire import SamplingParams
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing import fake_executor
from testing.fake_executor import FakeExecutor, drive, sample_token

BS, EOS, VOCAB = 4, 3, 64
ADAPTERS = {f"a{i}": f"/adapters/a{i}" for i in range(4)}


@pytest.fixture(autouse=True, params=[1, 2], ids=["sync", "async"])
def plan_depth(request, monkeypatch):
    monkeypatch.setattr(fake_executor, "DEFAULT_DEPTH", request.param)
    return request.param


def make(slots: int, nblocks: int = 64, mode: str = "recompute", ncpu: int = 0, seqs: int = 8,
         failing: frozenset[str] = frozenset(), paths=None):
    cfg = SchedulerConfig(block_size=BS, max_num_seqs=seqs, max_num_batched_tokens=32, max_model_len=256,
                          preemption_mode=mode, watermark=0.0, lora_slots=slots)
    sched = Scheduler(cfg, nblocks, ncpu, eos_token_ids=(EOS,), lora_paths=ADAPTERS if paths is None else paths)
    return sched, FakeExecutor(nblocks, ncpu, BS, VOCAB, check=sched.check_integrity, lora_slots=slots,
                               failing_loras=failing)


def req(rid: str, prompt: list[int], lora: str | None, max_tokens: int = 10, seed: int | None = None,
        n: int = 1) -> GenerationRequest:
    return GenerationRequest(rid, prompt, RequestParams(max_tokens=max_tokens, sampling=SamplingParams(seed=seed),
                                                        n=n), lora=lora)


def oracle(r: GenerationRequest, choice: int = 0) -> list[int]:
    seed = None if r.params.sampling.seed is None else r.params.sampling.seed + choice
    toks, out = list(r.prompt_token_ids), []
    while len(out) < r.params.max_tokens:
        t = sample_token(toks, seed, VOCAB, r.lora)
        toks.append(t)
        out.append(t)
        if t == EOS:
            break
    return out


def _check_outputs(outs, reqs) -> None:
    for r in reqs:
        for c in range(r.params.n):
            assert outs[(r.request_id, c)] == oracle(r, c), (r.request_id, r.lora, c)


def test_adapters_and_the_base_model_share_steps_each_sequence_under_its_own():
    rng = random.Random(0)
    shared = [rng.randrange(VOCAB) for _ in range(12)]
    names = [None, *ADAPTERS]
    reqs = [req(f"r{i}", shared + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 9))], names[i % 5],
                max_tokens=rng.randint(4, 14), seed=i, n=1 + (i % 3 == 0)) for i in range(20)]
    sched, ex = make(slots=2)
    mixed_steps = []

    def on_step(plan, _updates):
        slots = {ex.seqs[s].lora_slot for s in plan.scheduled_seq_ids if s in ex.seqs}
        mixed_steps.append(len(slots))

    for r in reqs:
        sched.add_request(r)
    outs = drive(sched, ex, on_step=on_step)
    _check_outputs(outs, reqs)
    assert max(mixed_steps) == 3  # two adapters and the base model in one step: never more adapters than slots
    assert sched.num_used_blocks == 0 and not sched.requests
    assert {name for _, name in ex.lora_loads} == set(ADAPTERS)


def test_the_same_prompt_under_two_adapters_shares_no_block_and_under_one_it_hits():
    prompt = list(range(10, 30))  # five full blocks
    sched, ex = make(slots=2)
    sched.add_request(req("x", prompt, "a0"))
    drive(sched, ex)
    hit0 = sched.prefix_cache_hit_tokens
    sched.add_request(req("y", prompt, "a1"))  # another adapter: the same tokens, other K/V
    sched.add_request(req("z", prompt, None))  # the base model: other K/V again
    drive(sched, ex)
    assert sched.prefix_cache_hit_tokens == hit0 == 0
    r = req("w", prompt, "a0")
    sched.add_request(r)
    outs = drive(sched, ex)
    assert sched.prefix_cache_hit_tokens == 16  # (four blocks: the last token is always computed)
    assert outs[("w", 0)] == oracle(r)


def test_with_one_slot_adapters_take_turns_least_recently_used_first_and_none_is_replaced_under_a_request():
    sched, ex = make(slots=1)
    reqs = [req(f"r{i}", [5 + i, 6, 7, 8, 9], ["a0", "a1", "a0", "a2"][i], max_tokens=6) for i in range(4)]
    for r in reqs:
        sched.add_request(r)
    outs = drive(sched, ex)  # (the fake fails the plan that replaces an adapter under a live sequence)
    _check_outputs(outs, reqs)
    assert [name for _, name in ex.lora_loads] == ["a0", "a1", "a0", "a2"]  # FCFS: the head waits for the slot


def test_lru_reuses_the_slot_already_holding_an_adapter():
    sched, ex = make(slots=2)
    for i, name in enumerate(["a0", "a1", "a0", "a1", "a0"]):
        sched.add_request(req(f"r{i}", [9, 8, 7, i], name, max_tokens=3))
        drive(sched, ex)
    assert [name for _, name in ex.lora_loads] == ["a0", "a1"]
    sched.add_request(req("r9", [1, 2, 3], "a2", max_tokens=3))
    drive(sched, ex)
    assert ex.lora_loads[-1] == (1, "a2")  # a1's slot was used least recently


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_keeps_each_request_under_its_adapter(mode):
    rng = random.Random(3)
    reqs = [req(f"r{i}", [rng.randrange(VOCAB) for _ in range(rng.randint(3, 12))], [None, "a0", "a1"][i % 3],
                max_tokens=16, seed=i) for i in range(9)]
    sched, ex = make(slots=2, nblocks=14, mode=mode, ncpu=32)
    for r in reqs:
        sched.add_request(r)
    outs = drive(sched, ex)
    assert sched.num_preemptions > 0
    _check_outputs(outs, reqs)
    assert sched.num_used_blocks == 0 and sched.lora.held()


def test_a_load_that_fails_fails_that_adapters_requests_with_the_reason_and_no_other():
    sched, ex = make(slots=2, failing=frozenset({"a1"}))
    good = [req("g0", [1, 2, 3, 4, 5], None, seed=1), req("g1", [1, 2, 3, 4, 6], "a0", seed=2)]
    bad = [req("b0", [7, 7, 7], "a1"), req("b1", [7, 7, 8], "a1")]
    for r in [good[0], bad[0], good[1], bad[1]]:
        sched.add_request(r)
    outs = drive(sched, ex)
    _check_outputs(outs, good)
    failed = {u.request_id: u.error for u in sched.failures}
    assert set(failed) == {"b0", "b1"}
    assert all("LoRA adapter 'a1' could not be loaded: /adapters/a1: no such adapter" in e for e in failed.values())
    assert sched.num_used_blocks == 0 and not sched.requests
    ex.failing_loras = frozenset()  # (the adapter is fixed): the next request loads it again
    r = req("b2", [7, 7, 9], "a1")
    sched.add_request(r)
    assert drive(sched, ex)[("b2", 0)] == oracle(r)


def test_an_executor_without_slots_cannot_hold_an_adapter_request_and_an_unknown_adapter_fails_alone():
    sched, _ = make(slots=0)
    why = sched.why_cannot_hold(req("x", [1, 2], "a0"))
    assert why is not None and "serves no LoRA adapters" in why and "'a0'" in why
    sched, ex = make(slots=1, paths={})
    sched.add_request(req("x", [1, 2, 3], "gone"))
    ok = req("y", [1, 2, 3], None)
    sched.add_request(ok)
    outs = drive(sched, ex)
    assert outs[("y", 0)] == oracle(ok)
    assert [u.request_id for u in sched.failures] == ["x"]


def test_a_waiting_request_whose_adapter_was_unloaded_fails_saying_so_and_running_ones_finish():
    paths = dict(ADAPTERS)
    sched, ex = make(slots=1, paths=paths)
    first = req("r0", [1, 2, 3, 4], "a0", max_tokens=6)
    sched.add_request(first)
    sched.add_request(req("r1", [1, 2, 3, 5], "a1"))  # waits: the one slot is a0's while r0 runs
    got = [t for u in sched.update(ex.run(sched.schedule())) for su in u.seqs for t in su.new_token_ids]
    del paths["a1"]  # unloaded while r1 waits; a0 too, while r0 runs under it
    del paths["a0"]
    outs = drive(sched, ex)
    assert got + outs[("r0", 0)] == oracle(first)
    # NOT_FOUND, as a request naming an adapter not served gets (a client's matter, not a server bug)
    assert [(u.request_id, u.error, u.error_kind) for u in sched.failures] == \
        [("r1", "the LoRA adapter 'a1' was unloaded before the request could start", ErrorKind.NOT_FOUND)]
    assert sched.num_used_blocks == 0 and not sched.requests


def test_an_adapter_named_like_a_load_at_run_time_of_another_name_is_another_adapter():
    """``x#1`` given at start and ``x`` loaded at run time (its first load, id 1) are two adapters: their
    own files, slots and prefix-cache chains (a key ``name#id`` for both served x#1's KV and files to x)."""
    paths = {lora_key("x#1"): "/adapters/start", lora_key("x", 1): "/adapters/run-time"}
    prompt = list(range(10, 30))  # five full blocks
    sched, ex = make(slots=2, paths=paths)
    loads = []
    sched.add_request(req("s", prompt, "x#1"))
    drive(sched, ex, on_step=lambda plan, _: loads.extend((x.name, x.path) for x in plan.lora_loads))
    r = req("r", prompt, "x")
    r.lora_id = 1
    sched.add_request(r)
    drive(sched, ex, on_step=lambda plan, _: loads.extend((x.name, x.path) for x in plan.lora_loads))
    assert sched.prefix_cache_hit_tokens == 0
    assert [path for _, path in loads] == ["/adapters/start", "/adapters/run-time"]
    assert len({name for name, _ in loads}) == 2 and len(set(sched.lora.held().values())) == 2
