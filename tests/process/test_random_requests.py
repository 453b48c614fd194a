"""Random sampling parameters, in and out of range, against real services: every call either
succeeds or is refused with INVALID_ARGUMENT (never INTERNAL), and a well-formed stream running
at the same time always completes, token for token."""

from __future__ import annotations

import threading

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.v1 import generation_pb2 as pb
from testing.stack import Stack

pytestmark = pytest.mark.slow
INT32 = st.integers(-(2**31), 2**31 - 1)
FLOAT = st.floats(width=32)  # NaN, infinities and extremes included


def _maybe(strategy):
    return st.none() | strategy


sampling = st.fixed_dictionaries({}, optional={
    "max_tokens": st.integers(-5, 6) | st.sampled_from([2**31 - 1, 5000]),
    "temperature": FLOAT | st.sampled_from([0.0, 0.7, 1e-6, 2.0]),
    "top_p": FLOAT | st.sampled_from([0.1, 0.95]),
    "top_k": INT32 | st.sampled_from([0, 1, 5, 511, 512, 513]),
    "min_p": FLOAT | st.sampled_from([0.0, 0.05, 1.0]),
    "seed": st.integers(0, 2**64 - 1),
    "n": st.integers(-2, 20),
    "beam_width": st.integers(-2, 20),
    "length_penalty": FLOAT | st.sampled_from([1000.0, -3e38, 0.5]),
    "early_stopping": st.booleans(),
    "stop": st.lists(st.text(max_size=6), max_size=4),
    "stop_token_ids": st.lists(st.integers(-3, 600), max_size=4),
    "ignore_eos": st.booleans(),
    "logprobs": st.integers(-2, 30),
    "repetition_penalty": FLOAT | st.sampled_from([1.0, 1.3, 1e30]),
    "presence_penalty": FLOAT | st.sampled_from([-2.0, 2.0, 2.5]),
    "frequency_penalty": FLOAT | st.sampled_from([-2.0, 0.3]),
})
prompts = st.one_of(st.text(min_size=0, max_size=40).map(lambda t: {"prompt": t}),
                    st.lists(st.integers(-3, 520), min_size=0, max_size=20).map(lambda ids: {"prompt_token_ids": ids}))


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tmp_path_factory):
    s = Stack(tiny_llama_dir, tmp_path_factory.mktemp("random"))
    try:
        s.start_scheduler()
        s.start_executor("ex0", "--kv-cache-memory", "2MiB")  # 256 blocks: big n x max_tokens cannot fit
        s.wait_health()
        yield s
    finally:
        s.stop()


def _well_formed(stack: Stack, n: int) -> list[int]:
    req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], sampling=pb.SamplingParams(
        max_tokens=n, temperature=0.0, ignore_eos=True))
    return [t for r in stack.stub.Generate(req, timeout=300) for c in r.choices for t in c.token_ids]


def test_random_requests_never_fail_internally_and_never_hurt_another(stack):
    reference = _well_formed(stack, 200)
    done: list = []
    steady = threading.Thread(target=lambda: done.append(_well_formed(stack, 200)))
    steady.start()
    codes: dict[str, int] = {}

    @settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck))
    @given(prompt=prompts, fields=sampling)
    def one(prompt, fields):
        req = pb.GenerateRequest(sampling=pb.SamplingParams(**fields), **prompt)
        try:
            for _ in stack.stub.Generate(req, timeout=120):
                pass
            codes["OK"] = codes.get("OK", 0) + 1
        except grpc.RpcError as e:
            codes[e.code().name] = codes.get(e.code().name, 0) + 1
            assert e.code() == grpc.StatusCode.INVALID_ARGUMENT, (e.code(), e.details(), prompt, fields)

    one()
    steady.join()
    assert done == [reference]  # the concurrent stream completed, unchanged
    assert codes.get("OK", 0) > 5 and codes.get("INVALID_ARGUMENT", 0) > 5, codes
