"""The gRPC servicer end to end: a real grpc.aio server on a free port over a fake engine."""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client import CollectorRegistry

from pagedserve.engine_api import FinishReason
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.telemetry.metrics import Metrics
from testing.grpc_fakes import FakeEngine, ServerThread, example_stats, make_tokenizer

LIMITS = ServerLimits(max_n=4, max_beam_width=4, max_stop_strings=3, max_stop_string_len=8,
                      max_stop_token_ids=4, max_logprobs=5)
METRICS = Metrics(CollectorRegistry())


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(make_tokenizer(), max_model_len=64)
    srv = ServerThread(engine, LIMITS, METRICS)
    yield srv
    srv.stop()


@pytest.fixture()
def engine(server):
    server.engine.reset()
    return server.engine


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.address) as channel:
        yield pb_grpc.GenerationStub(channel)


def generate(stub, timeout: float | None = 10.0, **kwargs) -> list[pb.GenerateResponse]:
    sampling = kwargs.pop("sampling", {})
    return list(stub.Generate(pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **kwargs),
                              timeout=timeout))


def status_of(stub, **kwargs) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, **kwargs)
    return info.value


def joined(responses: list[pb.GenerateResponse]) -> dict[int, tuple[str, list[int], list[int]]]:
    """Per choice: concatenated text, token ids, and the finish reasons seen (in order)."""
    out: dict[int, tuple[str, list[int], list[int]]] = {}
    for r in responses:
        for c in r.choices:
            text, ids, reasons = out.get(c.index, ("", [], []))
            out[c.index] = (text + c.text, ids + list(c.token_ids),
                            reasons + ([c.finish_reason] if c.finish_reason else []))
    return out


P = {"prompt": "Hello"}
INVALID = [  # (request fields, field named in the message, value shown in the message)
    ({**P, "sampling": {"temperature": -1.0}}, "sampling.temperature", "-1"),
    ({**P, "sampling": {"temperature": math.nan}}, "sampling.temperature", "nan"),
    ({**P, "sampling": {"temperature": math.inf}}, "sampling.temperature", "inf"),
    ({**P, "sampling": {"top_p": 0.0}}, "sampling.top_p", "(0, 1]"),
    ({**P, "sampling": {"top_p": 1.5}}, "sampling.top_p", "1.5"),
    ({**P, "sampling": {"top_p": math.nan}}, "sampling.top_p", "nan"),
    ({**P, "sampling": {"top_k": -2}}, "sampling.top_k", "must be -1 or 0 (off) or in [1, 2147483647] (got -2)"),
    ({**P, "sampling": {"min_p": 1.5}}, "sampling.min_p", "1.5"),
    ({**P, "sampling": {"min_p": -0.25}}, "sampling.min_p", "-0.25"),
    ({**P, "sampling": {"max_tokens": -3}}, "sampling.max_tokens", "-3"),
    ({**P, "sampling": {"max_tokens": 63}}, "sampling.max_tokens", "maximum context length is 64 tokens"),
    ({"prompt_token_ids": [5] * 64}, "prompt_token_ids", "64 tokens"),
    ({"prompt": "x " * 3000}, "prompt", "maximum context length is 64 tokens"),  # tokenized in a worker thread
    ({"prompt": ""}, "prompt", "empty"),
    ({}, "prompt", "neither"),
    ({"prompt": "Hi", "prompt_token_ids": [5]}, "prompt", "both"),
    ({"prompt_token_ids": [5, 300]}, "prompt_token_ids[1]", "300"),
    ({"prompt_token_ids": [-1]}, "prompt_token_ids[0]", "-1"),
    ({**P, "sampling": {"n": -1}}, "sampling.n", "-1"),
    ({**P, "sampling": {"n": 5}}, "sampling.n", "[1, 4]"),
    ({**P, "sampling": {"beam_width": -2}}, "sampling.beam_width", "-2"),
    ({**P, "sampling": {"beam_width": 5}}, "sampling.beam_width", "5"),
    ({**P, "sampling": {"n": 2, "beam_width": 2}}, "sampling.n", "beam_width=2"),
    ({**P, "sampling": {"stop": ["a", "b", "c", "d"]}}, "sampling.stop", "at most 3"),
    ({**P, "sampling": {"stop": ["ok", ""]}}, "sampling.stop[1]", "empty"),
    ({**P, "sampling": {"stop": ["123456789"]}}, "sampling.stop[0]", "at most 8"),
    ({**P, "sampling": {"stop_token_ids": [300]}}, "sampling.stop_token_ids[0]", "300"),
    ({**P, "sampling": {"stop_token_ids": [1, 2, 3, 4, 5]}}, "sampling.stop_token_ids", "at most 4"),
    ({**P, "sampling": {"logprobs": 6}}, "sampling.logprobs", "[0, 5]"),
    ({**P, "sampling": {"logprobs": -1}}, "sampling.logprobs", "-1"),
    ({**P, "sampling": {"repetition_penalty": 0.0}}, "sampling.repetition_penalty", "> 0"),
    ({**P, "sampling": {"repetition_penalty": math.inf}}, "sampling.repetition_penalty", "inf"),
    ({**P, "sampling": {"presence_penalty": 2.5}}, "sampling.presence_penalty", "2.5"),
    ({**P, "sampling": {"frequency_penalty": -3.0}}, "sampling.frequency_penalty", "-3"),
    ({**P, "sampling": {"frequency_penalty": math.nan}}, "sampling.frequency_penalty", "nan"),
    ({**P, "sampling": {"length_penalty": math.inf}}, "sampling.length_penalty", "inf"),
    ({**P, "request_id": "r" * 129}, "request_id", "129"),
    ({**P, "cache_salt": ""}, "cache_salt", "non-empty"),
    ({**P, "cache_salt": "s" * 1025}, "cache_salt", "at most 1024 characters"),
]


@pytest.mark.parametrize("fields,field,shown", INVALID, ids=[f"{c[1]}-{i}" for i, c in enumerate(INVALID)])
def test_invalid_input_is_invalid_argument_and_server_keeps_serving(stub, engine, fields, field, shown):
    err = status_of(stub, **fields)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith(field + ":"), err.details()
    assert shown in err.details(), err.details()
    assert engine.requests == []  # refused at the edge: the engine never saw it
    assert joined(generate(stub, prompt="Hello"))[0][2] == [FinishReason.EOS.value]


def test_rejections_are_counted_by_code(stub, engine):
    before = METRICS.rejected.labels("INVALID_ARGUMENT")._value.get()
    status_of(stub, prompt="")
    assert METRICS.rejected.labels("INVALID_ARGUMENT")._value.get() == before + 1


def test_request_fields_reach_the_engine(stub, engine):
    tok = make_tokenizer()
    generate(stub, request_id="req-1", prompt="Hello world", sampling=dict(
        max_tokens=5, temperature=0.5, top_p=0.75, top_k=7, min_p=0.125, seed=42, n=2, stop=["END", "END"],
        stop_token_ids=[9], ignore_eos=True, logprobs=3, repetition_penalty=1.25, presence_penalty=0.5,
        frequency_penalty=-0.5), cache_salt="tenant-a")
    (req,) = engine.requests
    assert req.request_id == "req-1" and req.cache_salt == "tenant-a"
    assert req.prompt_token_ids == tok.encode("Hello world").ids and req.prompt_token_ids[0] == 0  # BOS
    p, s = req.params, req.params.sampling
    assert (p.max_tokens, p.n, p.beam_width, p.stop, p.stop_token_ids, p.ignore_eos, s.logprobs) == (
        5, 2, 1, ["END"], [9], True, 3)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed) == (0.5, 0.75, 7, 0.125, 42)
    assert (s.repetition_penalty, s.presence_penalty, s.frequency_penalty) == (1.25, 0.5, -0.5)
    assert s.want_logprobs and s.logprobs == 3
    assert 0 < req.arrival_time <= time.monotonic()


def test_defaults_when_fields_are_unset(stub, engine):
    responses = generate(stub, prompt_token_ids=[0] + [5] * 55, timeout=None)  # 56 tokens: 8 left in the context
    (req,) = engine.requests
    assert len(req.request_id) == 32 and responses[0].request_id == req.request_id  # generated, echoed
    p, s = req.params, req.params.sampling
    assert (p.max_tokens, p.n, p.beam_width, p.stop) == (8, 1, 1, [])  # min(16, room)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.seed, s.want_logprobs) == (1.0, 1.0, 0, 0.0, None, False)
    assert req.deadline is None and req.cache_salt is None


def test_streaming_deltas_concatenate_and_usage_is_last(stub, engine):
    tok = make_tokenizer()
    engine.completions = ["Grüße aus München 🙂 café", "日本語のテキスト"]
    responses = generate(stub, prompt="Hi", sampling={"n": 2, "max_tokens": 40, "logprobs": 2})
    choices = joined(responses)
    for i, text in enumerate(engine.completions):
        got_text, ids, reasons = choices[i]
        assert got_text == text and "\ufffd" not in got_text
        assert ids == tok.encode(text, add_special_tokens=False).ids + [1]
        assert reasons == [FinishReason.EOS.value]  # set once, on the last delta
    assert all(not r.HasField("usage") for r in responses[:-1])
    usage = responses[-1].usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.cached_prompt_tokens) == (
        len(tok.encode("Hi").ids), len(choices[0][1]) + len(choices[1][1]), 3)
    assert (usage.spec_proposed_tokens, usage.spec_accepted_tokens) == (0, 0)  # not speculated
    lp = responses[0].choices[0].logprobs[0]
    assert lp.token_id == responses[0].choices[0].token_ids[0] and len(lp.top_logprobs) == 2
    assert len(responses) > 5  # really streamed, one message per step


def test_stop_string_and_length_finish(stub, engine):
    engine.completions = ["Hello world, the end."]
    (text, _, reasons) = joined(generate(stub, prompt="Hi", sampling={"stop": ["d, t"], "max_tokens": 40}))[0]
    assert (text, reasons) == ("Hello worl", [FinishReason.STOP.value])
    (text, ids, reasons) = joined(generate(stub, prompt="Hi", sampling={"max_tokens": 3}))[0]
    assert len(ids) == 3 and reasons == [FinishReason.LENGTH.value]
    assert text == make_tokenizer().decode(ids)


def test_the_last_delta_of_a_choice_a_stop_string_ended_names_it():
    from pagedserve.engine_api import ChoiceDelta, RequestOutput
    from scheduler_svc.front.grpc.servicer import _response

    def last(stop_reason, finish=FinishReason.STOP) -> pb.Choice:
        return _response(RequestOutput("r", [ChoiceDelta(0, finish_reason=finish, stop_reason=stop_reason)])).choices[0]

    assert (last("d, t").WhichOneof("stop_reason"), last("d, t").stop_string) == ("stop_string", "d, t")
    assert (last(7).WhichOneof("stop_reason"), last(7).stop_token_id) == ("stop_token_id", 7)
    assert last(None, FinishReason.EOS).WhichOneof("stop_reason") is None


def test_stop_reason_reaches_a_grpc_client(stub, engine):
    engine.completions = ["Hello world, the end."]
    out = generate(stub, prompt="Hi", sampling={"stop": ["d, t"], "max_tokens": 40})
    assert [c.stop_string for m in out for c in m.choices if c.finish_reason] == ["d, t"]


@pytest.mark.parametrize("mode,code", [
    ("queue_full", grpc.StatusCode.RESOURCE_EXHAUSTED),
    ("no_executor", grpc.StatusCode.UNAVAILABLE),
    ("fail", grpc.StatusCode.INTERNAL),
    ("crash", grpc.StatusCode.INTERNAL),
])
def test_engine_errors_map_to_status_codes(stub, engine, mode, code):
    engine.mode = mode
    got = []
    with pytest.raises(grpc.RpcError) as info:
        for r in stub.Generate(pb.GenerateRequest(prompt="Hi"), timeout=10):
            got.append(r)
    assert info.value.code() == code, info.value.details()
    assert len(got) == (1 if mode in ("fail", "crash") else 0)  # mid-stream failures after one message
    assert engine.closed_event.wait(5)
    engine.reset()
    assert joined(generate(stub, prompt="Hello"))[0][0]  # the server keeps serving


def test_malformed_engine_output_is_internal(stub, engine):
    engine.mode = "bad_logprobs"
    assert status_of(stub, prompt="Hi", sampling={"logprobs": 2}).code() == grpc.StatusCode.INTERNAL
    assert engine.closed_event.wait(30) and engine.closed[0][1] is False


def test_concurrent_streams_do_not_mix(stub, engine):
    engine.token_delay = 0.002
    engine.completions = ["Grüße aus München", "The quick brown fox", "日本語のテキスト"]
    with ThreadPoolExecutor(max_workers=12) as pool:
        futures = [pool.submit(generate, stub, request_id=f"c{i}", prompt="Hi",
                               sampling={"n": 1 + i % 3, "max_tokens": 60})
                   for i in range(24)]
        results = [f.result() for f in futures]
    for i, responses in enumerate(results):
        assert {r.request_id for r in responses} == {f"c{i}"}
        choices = joined(responses)
        assert [choices[k][0] for k in sorted(choices)] == engine.completions[: 1 + i % 3]
    assert len(engine.closed) == 24 and all(done for _, done in engine.closed)


def test_no_model_info_is_unavailable_and_says_the_last_executor_left(stub, engine):
    stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)  # a model was served
    info, engine.info = engine.info, None
    try:
        err = status_of(stub, prompt="Hi")
        assert err.code() == grpc.StatusCode.UNAVAILABLE and "the last one left" in err.details()
        with pytest.raises(grpc.RpcError) as e:
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "the last one left" in e.value.details()
    finally:
        engine.info = info


def test_cancel_mid_stream_closes_the_engine_generator(stub, engine):
    engine.token_delay = 0.05
    engine.completions = ["The quick brown fox jumps over the lazy dog. " * 3]
    call = stub.Generate(pb.GenerateRequest(request_id="cancel-me", prompt="Hi",
                                            sampling=pb.SamplingParams(max_tokens=60)), timeout=30)
    next(call)
    call.cancel()
    assert engine.closed_event.wait(30), "engine generator not closed after cancel"
    assert engine.closed == [("cancel-me", False)]  # closed early, not run to completion


def test_cancel_while_the_server_writes_closes_the_engine_generator(stub, engine):
    engine.mode = "endless"  # the engine never awaits: the cancel lands in context.write
    call = stub.Generate(pb.GenerateRequest(request_id="flood", prompt="Hi"), timeout=30)
    next(call)
    call.cancel()
    assert engine.closed_event.wait(30), "engine generator not closed after cancel"
    assert engine.closed == [("flood", False)]


def test_deadline_propagates_and_expiry_closes_the_generator(stub, engine):
    generate(stub, prompt="Hi", timeout=5.0)
    req = engine.requests[-1]
    # grpc rounds the timeout it sends up a little, hence the slack above 5 s.
    assert req.deadline is not None and 4.0 < req.deadline - req.arrival_time <= 5.05
    engine.reset()
    engine.token_delay = 0.05
    engine.completions = ["The quick brown fox jumps over the lazy dog. " * 3]
    err = status_of(stub, prompt="Hi", sampling={"max_tokens": 60}, timeout=0.4)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert engine.closed_event.wait(30)
    assert engine.closed[0][1] is False


def test_duplicate_request_id_in_flight_is_refused(stub, engine):
    engine.token_delay = 0.05
    engine.completions = ["The quick brown fox jumps over the lazy dog. " * 3]
    first = stub.Generate(pb.GenerateRequest(request_id="dup", prompt="Hi",
                                             sampling=pb.SamplingParams(max_tokens=60)), timeout=30)
    next(first)
    assert status_of(stub, request_id="dup", prompt="Hi").code() == grpc.StatusCode.ALREADY_EXISTS
    first.cancel()
    assert engine.closed_event.wait(2.0)


def test_model_info_maps_all_fields(stub, engine):
    info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    e = engine.info
    assert (info.model_name, info.architecture, info.max_model_len, info.vocab_size, info.block_size,
            info.num_executors, info.eos_token_id, list(info.eos_token_ids)) == (
        e.model_name, e.architecture, e.max_model_len, e.vocab_size, e.block_size, e.num_executors,
        e.eos_token_ids[0], list(e.eos_token_ids))
    assert (info.limits.max_n, info.limits.max_logprobs, info.limits.default_max_tokens) == (4, 5, 16)


def test_stats_map_all_fields(stub, engine):
    engine.engine_stats = s = example_stats()
    got = stub.GetStats(pb.GetStatsRequest(), timeout=5)
    for name in ("num_running", "num_waiting", "num_swapped", "num_preemptions", "prefix_cache_query_tokens",
                 "prefix_cache_hit_tokens", "num_migrations"):
        assert getattr(got, name) == getattr(s, name), name
    assert len(got.executors) == 2
    for g, e in zip(got.executors, s.executors, strict=True):
        for name in e.__dataclass_fields__:  # every field, tensor_parallel_size included
            assert getattr(g, name) == getattr(e, name), name


def test_finish_reason_numbering_matches_engine():
    assert {n.removeprefix("FINISH_REASON_"): v for n, v in pb.FinishReason.items()} == {
        r.name: r.value for r in FinishReason}


def test_reflection_lists_the_service(server):
    with grpc.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in next(replies).list_services_response.service}
    assert {"pagedserve.v1.Generation", "grpc.health.v1.Health"} <= names


def test_health_follows_readiness_and_shutdown():
    engine = FakeEngine(make_tokenizer())
    srv = ServerThread(engine)
    try:
        with grpc.insecure_channel(srv.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)

            def status(service: str) -> int:
                return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

            serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
            assert (status(""), status("pagedserve.v1.Generation"), status("liveness")) == (
                not_serving, not_serving, serving)
            engine.ready = True
            srv.call(srv.api.update_health())
            assert (status(""), status("pagedserve.v1.Generation")) == (serving, serving)
            engine.ready = False  # the last executor left
            srv.call(srv.api.update_health())
            assert status("") == not_serving
            engine.ready = True
            srv.call(srv.api.update_health())
            srv.call(srv.api.begin_shutdown())
            assert (status(""), status("pagedserve.v1.Generation"), status("liveness")) == (
                not_serving, not_serving, serving)
            err = status_of(pb_grpc.GenerationStub(channel), prompt="Hi")
            assert err.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in err.details()
    finally:
        srv.stop()


def test_structured_outputs_and_prompt_logprobs_over_grpc(stub, engine):
    so = pb.StructuredOutputs(json_schema='{"type": "object"}')
    responses = generate(stub, prompt="Hello world", sampling=dict(
        max_tokens=4, structured_outputs=so, prompt_logprobs=1, logit_bias={5: -2.0}, min_tokens=1))
    sp = engine.requests[-1].params.sampling
    assert sp.structured.spec == '{"type":"object"}' and sp.prompt_logprobs == 1 and sp.logit_bias == [(5, -2.0)]
    first = responses[0].prompt_logprobs
    ids = engine.requests[-1].prompt_token_ids
    assert [p.token_id for p in first[1:]] == ids[1:] and not first[0].HasField("logprob")
    assert first[1].logprob == pytest.approx(-1.0) and len(first[1].top_logprobs) == 1
    assert [p.rank for p in first[1:3]] == [2, 3] and not first[0].HasField("rank")
    assert all(not r.prompt_logprobs for r in responses[1:])  # on the first message only


def test_final_usage_reports_speculative_acceptance(stub, engine):
    engine.spec_usage = (9, 4)
    responses = generate(stub, prompt="Hi", sampling={"max_tokens": 40})
    assert all(not r.HasField("usage") for r in responses[:-1])
    usage = responses[-1].usage
    assert (usage.spec_proposed_tokens, usage.spec_accepted_tokens) == (9, 4)
