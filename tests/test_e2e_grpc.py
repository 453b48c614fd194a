"""End to end: real scheduler and executor processes over real gRPC and ZeroMQ."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pagedserve.v1 import generation_pb2 as pb
from stack import Stack

pytestmark = pytest.mark.slow
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tmp_path_factory):
    s = Stack(tiny_llama_dir, tmp_path_factory.mktemp("e2e"))
    try:
        s.start_scheduler()
        s.start_executor("ex0")
        s.wait_health()
        yield s
    finally:
        s.stop()


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


def _wait_blocks_free(stack: Stack, timeout_s: float = 20.0) -> pb.Stats:
    deadline = time.monotonic() + timeout_s
    while True:
        st = stack.stats()
        if all(e.kv_blocks_used == 0 for e in st.executors) and st.num_running == 0 and st.num_waiting == 0:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"blocks still held: {st}")
        time.sleep(0.1)


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
    _wait_blocks_free(stack)


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
    _wait_blocks_free(stack)


def test_deadline_aborts_and_frees(stack):
    req = pb.GenerateRequest(prompt_token_ids=list(range(3, 60)), sampling=_greedy(2000 - 60))
    with pytest.raises(grpc.RpcError) as err:
        _collect(stack.stub, req, timeout=0.5)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_blocks_free(stack)


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
