"""End to end: real scheduler and executor processes over real gRPC and ZeroMQ."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagedserve.v1 import generation_pb2 as pb
from testing.stack import Stack

pytestmark = pytest.mark.slow
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module", params=["1-front-1-core", "2-fronts-2-cores"])
def stack(request, tiny_llama_dir, tmp_path_factory):
    """The same tests through one front and one engine core, and through two of each (two executors,
    which the directory spreads over the cores): nothing may change for clients."""
    many = request.param == "2-fronts-2-cores"
    args = ["--api-server-count", "2", "--engine-cores", "2"] if many else []
    with Stack.running(tiny_llama_dir, tmp_path_factory.mktemp("e2e"), scheduler_args=args,
                       executors=("ex0", "ex1") if many else ("ex0",)) as s:
        if many:
            s.wait_executors(2)
        yield s


def _greedy(max_tokens: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


def _collect(stub, req, timeout=60):
    tokens: dict[int, list[int]] = {}
    text: dict[int, str] = {}
    finish, usage = {}, None
    for resp in stub.Generate(req, timeout=timeout):
        for c in resp.choices:
            tokens.setdefault(c.index, []).extend(c.token_ids)
            text[c.index] = text.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        if resp.HasField("usage"):
            usage = resp.usage
    return tokens, text, finish, usage



def test_greedy_stream_matches_transformers(stack, tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    prompts = [[5, 17, 99, 3, 250, 31, 7], list(range(40, 75))]
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    for prompt in prompts:
        tokens, text, finish, usage = _collect(
            stack.stub, pb.GenerateRequest(prompt_token_ids=prompt, sampling=_greedy(24)))
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
        assert tokens[0] == ref
        assert finish[0] == pb.FINISH_REASON_LENGTH
        assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == 24


def test_text_prompt_and_prefix_cache_hit(stack):
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    _, text1, _, u1 = _collect(stack.stub, pb.GenerateRequest(prompt=prompt, sampling=_greedy(8)))
    _, text2, _, u2 = _collect(stack.stub, pb.GenerateRequest(prompt=prompt, sampling=_greedy(8)))
    assert text1 == text2 and text1[0]
    assert u2.cached_prompt_tokens > 0
    assert u2.cached_prompt_tokens >= (u2.prompt_tokens - 1) // 16 * 16 - 16
    st = stack.stats()
    assert st.prefix_cache_hit_tokens >= u2.cached_prompt_tokens


def test_64_concurrent_streams_complete(stack):
    results: list = [None] * 64

    def run(i: int) -> None:
        prompt = [(i * 7 + j) % 400 + 3 for j in range(5 + i % 23)]
        results[i] = _collect(stack.stub, pb.GenerateRequest(prompt_token_ids=prompt,
                                                             sampling=_greedy(6 + i % 10)), timeout=120)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, (tokens, _, finish, usage) in enumerate(results):
        assert len(tokens[0]) == 6 + i % 10 and finish[0] == pb.FINISH_REASON_LENGTH
        assert usage.completion_tokens == 6 + i % 10
    stack.wait_blocks_free()


def test_cancel_half_of_64_streams_frees_every_block(stack):
    done = [False] * 64

    def run(i: int) -> None:
        prompt = [(i * 11 + j) % 400 + 3 for j in range(20)]
        call = stack.stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, sampling=_greedy(40)),
                                   timeout=120)
        n = 0
        try:
            for resp in call:
                n += sum(len(c.token_ids) for c in resp.choices)
                if i % 2 == 0 and n >= 3:
                    call.cancel()
            done[i] = True
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.CANCELLED and i % 2 == 0
            done[i] = "cancelled"

    threads = [threading.Thread(target=run, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(done[i] is True for i in range(1, 64, 2))
    assert sum(d == "cancelled" for d in done) >= 16
    stack.wait_blocks_free()


def test_deadline_aborts_and_frees(stack):
    req = pb.GenerateRequest(prompt_token_ids=list(range(3, 60)), sampling=_greedy(2000 - 60))
    with pytest.raises(grpc.RpcError) as err:
        _collect(stack.stub, req, timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    stack.wait_blocks_free()


@pytest.mark.parametrize("sampling,field", [
    (pb.SamplingParams(max_tokens=4, temperature=-1.0), "temperature"),
    (pb.SamplingParams(max_tokens=4, top_p=0.0), "top_p"),
    (pb.SamplingParams(max_tokens=4, top_k=-2), "top_k"),
    (pb.SamplingParams(max_tokens=4, min_p=1.5), "min_p"),
    (pb.SamplingParams(max_tokens=-1), "max_tokens"),
    (pb.SamplingParams(max_tokens=100000), "max_tokens"),
    (pb.SamplingParams(max_tokens=4, n=-1), "n"),
    (pb.SamplingParams(max_tokens=4, stop=[""]), "stop"),
])
def test_invalid_input_is_refused_and_server_keeps_serving(stack, sampling, field):
    with pytest.raises(grpc.RpcError) as err:
        _collect(stack.stub, pb.GenerateRequest(prompt="hello", sampling=sampling))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()
    tokens, _, _, _ = _collect(stack.stub, pb.GenerateRequest(prompt="hello", sampling=_greedy(2)))
    assert len(tokens[0]) == 2


def test_token_ids_outside_vocabulary(stack):
    with pytest.raises(grpc.RpcError) as err:
        _collect(stack.stub, pb.GenerateRequest(prompt_token_ids=[1, 10**6], sampling=_greedy(2)))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt_token_ids" in err.value.details()


def test_unavailable_until_an_executor_joins(tiny_llama_dir, tmp_path):
    s = Stack(tiny_llama_dir, tmp_path)
    try:
        s.start_scheduler()
        assert s.health() != SERVING
        with pytest.raises(grpc.RpcError) as err:
            _collect(s.stub, pb.GenerateRequest(prompt="hi", sampling=_greedy(2)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        s.start_executor("late")
        s.wait_health()
        tokens, _, _, _ = _collect(s.stub, pb.GenerateRequest(prompt="hi", sampling=_greedy(3)))
        assert len(tokens[0]) == 3
    finally:
        s.stop()


def test_parallel_sampling_choices_equal_their_seeds_alone(stack):
    prompt = [9, 8, 7, 6, 5, 4, 3, 120, 121, 122]

    def sampling(n: int, seed: int) -> pb.SamplingParams:
        return pb.SamplingParams(max_tokens=12, temperature=0.9, top_k=40, seed=seed, n=n, ignore_eos=True)

    tokens, text, finish, usage = _collect(stack.stub, pb.GenerateRequest(prompt_token_ids=prompt,
                                                                          sampling=sampling(3, 1000)))
    assert sorted(tokens) == [0, 1, 2] and all(f == pb.FINISH_REASON_LENGTH for f in finish.values())
    assert usage.completion_tokens == 36
    for i in range(3):  # the documented rule: choice i samples with seed + i
        alone, _, _, _ = _collect(stack.stub, pb.GenerateRequest(prompt_token_ids=prompt,
                                                                 sampling=sampling(1, 1000 + i)))
        assert alone[0] == tokens[i]
    assert len({tuple(t) for t in tokens.values()}) > 1  # independent samples, not copies


def test_beam_search_over_grpc_matches_transformers(stack, tiny_llama_dir):
    import torch
    from transformers import AutoModelForCausalLM

    prompt = [5, 17, 99, 3, 250, 31, 7]
    tokens, _, finish, usage = _collect(stack.stub, pb.GenerateRequest(
        prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=10, beam_width=3, ignore_eos=True)))
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), num_beams=3, num_return_sequences=3, do_sample=False,
                          early_stopping=False, max_new_tokens=10, eos_token_id=None, pad_token_id=0)
    assert [tokens[i] for i in range(3)] == ref[:, len(prompt):].tolist()  # best first
    assert usage.completion_tokens == 30


def test_mixed_sharing_requests_cancelled_or_finished_hold_no_blocks(stack):
    results: list = [None] * 12

    def run(i: int) -> None:
        sp = (pb.SamplingParams(max_tokens=30, n=4, temperature=1.0, seed=i, ignore_eos=True) if i % 3 == 0 else
              pb.SamplingParams(max_tokens=30, beam_width=2 + i % 3, ignore_eos=True) if i % 3 == 1 else
              pb.SamplingParams(max_tokens=30, n=2, temperature=0.7, ignore_eos=True))
        call = stack.stub.Generate(pb.GenerateRequest(prompt_token_ids=[3 + i] * 20 + [7, 8], sampling=sp),
                                   timeout=120)
        try:
            for n, _ in enumerate(call):
                if i % 2 == 0 and n >= 2:
                    call.cancel()
            results[i] = "done"
        except grpc.RpcError as e:
            results[i] = e.code()

    shared_seen = []

    def watch(stop: threading.Event) -> None:
        while not stop.is_set():
            shared_seen.append(max((e.kv_blocks_shared for e in stack.stats().executors), default=0))
            time.sleep(0.02)

    stop = threading.Event()
    watcher = threading.Thread(target=watch, args=(stop,))
    watcher.start()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    watcher.join()
    assert all(r in ("done", grpc.StatusCode.CANCELLED) for r in results), results
    assert max(shared_seen) > 0  # GetStats shows the prompt blocks the choices share
    stack.wait_blocks_free()


def test_sigterm_stops_admitting_aborts_leftovers_after_the_grace_and_exits(tiny_llama_dir, tmp_path):
    s = Stack(tiny_llama_dir, tmp_path, scheduler_args=["--shutdown-grace-seconds", "1"])
    try:
        s.start_scheduler()
        s.start_executor("ex0", "--decode-steps", "1")  # (slower: the request outlives the grace period)
        s.wait_health()
        finish: list = []
        got = threading.Event()

        def run() -> None:
            # As long as the model allows (4096 positions): a faster machine, or a scheduler slow to take
            # the signal under load, must not let it finish within the grace period.
            req = pb.GenerateRequest(prompt_token_ids=list(range(3, 40)), sampling=_greedy(4000))
            for resp in s.stub.Generate(req, timeout=60):
                got.set()
                finish.extend(c.finish_reason for c in resp.choices if c.finish_reason)

        t = threading.Thread(target=run)
        t.start()
        assert got.wait(30)
        s.scheduler.send_signal(signal.SIGTERM)
        dropped_by = time.monotonic() + 1.0  # readiness drops at once: well within the 1 s grace period
        while s.health() == SERVING:
            assert time.monotonic() < dropped_by, "still SERVING after SIGTERM"
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as err:
            _collect(s.stub, pb.GenerateRequest(prompt="late", sampling=_greedy(2)))
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        t.join(30)
        assert finish == [pb.FINISH_REASON_ABORTED]  # cut at the grace period, told so
        assert s.scheduler.wait(timeout=20) == 0
    finally:
        s.stop()
