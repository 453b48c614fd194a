"""Large requests are decoded, and their counts checked, in the parse worker, never on the front's
event loop (issue #44): the caps derived from the model, the same refusals whichever path a
body takes, the worker's reply rebuilt exactly, its queue bounded (503), a dead worker replaced,
and the loop kept free while large bodies decode."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import msgspec
import pytest

from pagedserve.engine_api import ModelInfo
from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.front.api_errors import ApiError
from scheduler_svc.front.guards.request_caps import RequestCaps, check_generate
from scheduler_svc.front.http import body_parser
from scheduler_svc.front.http.body_parser import BodyParser
from scheduler_svc.front.http.openai_types import ChatRequest, CompletionRequest
from scheduler_svc.front.input.parse_pool import ParseWorker
from scheduler_svc.front.input.server_limits import ServerLimits

MODEL = ModelInfo("m", "LlamaForCausalLM", max_model_len=4096, vocab_size=32000, block_size=16, num_executors=1)
CAPS = RequestCaps.derive(ServerLimits(), MODEL, prompts=64, messages=1024, tools=128)


def _run(coro_fn):
    """``coro_fn(parser)`` on a fresh loop with a parser of its own, its worker closed after."""
    async def main():
        worker = ParseWorker()
        try:
            return await coro_fn(BodyParser(worker=worker), worker)
        finally:
            await worker.close()
    return asyncio.run(main())


def test_the_caps_follow_the_model_and_the_limits():
    assert CAPS.max_model_len == 4096 and CAPS.logit_bias == 1024 and CAPS.stop_strings == 16
    small_vocab = ModelInfo("m", "x", max_model_len=64, vocab_size=100, block_size=16, num_executors=1)
    assert RequestCaps.derive(ServerLimits(), small_vocab, 1, 0, 0).logit_bias == 100  # no more than the vocabulary
    assert RequestCaps.derive(ServerLimits(max_stop_strings=3), MODEL, 1, 0, 0).stop_strings == 3
    assert RequestCaps.from_wire(CAPS.to_wire()) == CAPS


def test_a_large_body_is_decoded_by_the_worker_and_rebuilt_exactly(monkeypatch):
    """Every field of a legitimate large chat body survives the worker's round trip; the front
    decodes only the small body itself."""
    inline_sizes: list[int] = []
    real_decode = body_parser.decode
    monkeypatch.setattr(body_parser, "decode", lambda b, k: inline_sizes.append(len(b)) or real_decode(b, k))
    tool = {"type": "function", "function": {"name": "f", "description": "d" * 2000,
                                             "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}}
    chat = {"model": "m", "messages": [{"role": "user", "content": "hi " * 100_000},
                                       {"role": "assistant", "content": None,
                                        "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": {"x": 1}}}]}],
            "tools": [tool] * 100, "tool_choice": {"type": "function", "function": {"name": "f"}},
            "logit_bias": {"5": -1.5}, "stop": ["a", "b"], "seed": 7, "temperature": 0.5,
            "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "object"}}}}
    body = msgspec.json.encode(chat)
    assert len(body) > body_parser.LARGE_BODY_BYTES

    async def go(parser, worker):
        large = await parser.decode(body, ChatRequest, CAPS)
        small = await parser.decode(b'{"prompt": "hi"}', CompletionRequest, CAPS)
        return large, small, parser.offloaded

    large, small, offloaded = _run(go)
    assert large == msgspec.json.decode(body, type=ChatRequest)
    assert small.prompt == "hi" and offloaded == 1
    assert inline_sizes == [len(b'{"prompt": "hi"}')]  # the large body was never decoded in this process


@pytest.mark.parametrize("field, value, message", [
    ("stop", ["s"] * 80_000, "stop: at most 64 entries as sent, duplicates included (got 80000)"),
    ("logit_bias", {str(i): 1.0 for i in range(30_000)}, "logit_bias: at most 1024 entries (got 30000)"),
    ("prompt", [5] * 150_000, "prompt: This model's maximum context length is 4096 tokens. However, "
                          "the prompt has 150000 tokens, which leaves no room to generate: at most 4095 are allowed. "
                          "Please reduce the length of the prompt."),
    ("stop_token_ids", list(range(60_000)), "stop_token_ids: at most 256 entries as sent, duplicates included (got 60000)"),
])
def test_counts_over_their_caps_are_refused_the_same_whichever_path(field, value, message):
    """A large body is refused by the worker with the words a small one gets in the front."""
    big = msgspec.json.encode({"prompt": "hi", field: value})
    over = ["s"] * 65 if field == "stop" else None  # a small body over the same cap
    assert len(big) > body_parser.LARGE_BODY_BYTES

    async def go(parser, worker):
        with pytest.raises(ApiError) as e:
            await parser.decode(big, CompletionRequest, CAPS)
        if over is not None:
            with pytest.raises(ApiError) as small:
                await parser.decode(msgspec.json.encode({"prompt": "hi", field: over}), CompletionRequest, CAPS)
            assert small.value.message == "stop: at most 64 entries as sent, duplicates included (got 65)"
        return e.value, worker.handled

    err, handled = _run(go)
    assert (err.status, err.message, err.param) == (400, message, field) and handled == 1


def test_too_many_tools_or_prompts_or_a_huge_schema_are_refused():
    tool = {"function": {"name": "f", "parameters": {"type": "object"}}}
    cases = [
        (ChatRequest, {"messages": [{"role": "user", "content": "x" * 300_000}], "tools": [tool] * 129},
         "tools: at most 128 tools per request (got 129)"),
        (CompletionRequest, {"prompt": [[1, 2]] * 70_000}, "prompt: at most 64 prompts per request (got 70000)"),
        (CompletionRequest, {"prompt": "x", "guided_json": {"enum": ["v" * 10] * 30_000}},
         "guided_json: must be at most 65536 characters"),
    ]

    async def go(parser, worker):
        out = []
        for kind, body, _ in cases:
            with pytest.raises(ApiError) as e:
                await parser.decode(msgspec.json.encode(body), kind, CAPS)
            out.append(e.value.message)
        return out

    for (_, _, expected), got in zip(cases, _run(go), strict=True):
        assert got.startswith(expected), got


def test_a_full_worker_queue_answers_503_with_retry_after():
    body = msgspec.json.encode({"prompt": list(range(60_000))})

    async def go(parser, worker):
        worker.queue_bytes = 2 * len(body)
        return await asyncio.gather(*(parser.decode(body, CompletionRequest, CAPS) for _ in range(3)),
                                    return_exceptions=True)

    results = _run(go)
    busy = [r for r in results if isinstance(r, ApiError) and r.status == 503]
    assert len(busy) == 1 and busy[0].headers == {"retry-after": "1"} and busy[0].code == "server_busy"
    assert sum(isinstance(r, ApiError) and r.status == 400 for r in results) == 2  # longer than the model


def test_a_dead_worker_is_replaced_and_a_stuck_one_costs_one_request_a_503():
    body = msgspec.json.encode({"prompt": "x" * 300_000})

    async def go(parser, worker):
        first = await parser.decode(body, CompletionRequest, CAPS)
        os.kill(worker.pid, signal.SIGKILL)  # between requests: the next one starts a new worker
        await asyncio.sleep(0.2)
        second = await parser.decode(body, CompletionRequest, CAPS)
        worker.decode_timeout_s = 0.5
        os.kill(worker.pid, signal.SIGSTOP)  # stuck mid-request: killed after the timeout
        with pytest.raises(ApiError) as e:
            await parser.decode(body, CompletionRequest, CAPS)
        worker.decode_timeout_s = 10.0
        third = await parser.decode(body, CompletionRequest, CAPS)
        return [first.prompt, second.prompt, third.prompt], e.value, worker.starts

    prompts, err, starts = _run(go)
    assert prompts == ["x" * 300_000] * 3 and starts == 3
    assert err.status == 503 and "restarted" in err.message and err.headers == {"retry-after": "1"}


def test_the_loop_keeps_ticking_while_large_bodies_decode():
    """Five 5 MB bodies of one-letter stop strings, each about 60 ms (this machine: 40-70) of
    msgspec holding the GIL: decoded in this process the loop would stall at least one whole decode;
    in the worker, the loop's longest stall stays under half of one (the pipe write and a refusal)."""
    body = msgspec.json.encode({"prompt": "hi", "stop": ["a"] * 1_300_000})
    start = time.perf_counter()
    msgspec.json.decode(body, type=CompletionRequest)
    one_decode = time.perf_counter() - start

    async def go(parser, worker):
        await parser.decode(msgspec.json.encode({"prompt": "x" * 300_000}), CompletionRequest, CAPS)  # started
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        for _ in range(5):
            with pytest.raises(ApiError):
                await parser.decode(body, CompletionRequest, CAPS)
        done.set()
        await tick
        return max(gaps)

    worst_gap = _run(go)
    print(f"one decode {one_decode * 1e3:.1f} ms; the loop's longest stall {worst_gap * 1e3:.1f} ms")
    assert worst_gap < one_decode / 2, (worst_gap, one_decode)


def test_a_generate_request_over_its_caps_is_named_from_lengths_alone():
    req = pb.GenerateRequest(prompt_token_ids=[3] * 5000)
    assert check_generate(req, CAPS) .startswith("prompt_token_ids: This model's maximum context length is 4096 tokens. "
                                             "However, the prompt has 5000 tokens")
    req = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(stop=["a"] * 65))
    assert check_generate(req, CAPS) == "sampling.stop: at most 64 entries as sent, duplicates included (got 65)"
    req = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(stop_token_ids=[1] * 257))
    assert check_generate(req, CAPS) == \
        "sampling.stop_token_ids: at most 256 entries as sent, duplicates included (got 257)"
    req = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(logit_bias={i: 1.0 for i in range(1025)}))
    assert check_generate(req, CAPS) == "sampling.logit_bias: at most 1024 entries (got 1025)"
    # (the validator counts distinct strings and ids against 16 and 64 afterwards)
    ok = pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(stop=["a"] * 64, stop_token_ids=[1] * 256))
    assert check_generate(ok, CAPS) is None


def test_a_large_grpc_message_is_checked_in_the_worker_before_the_front_parses_it():
    """Under the model's message cap but over the stop-string cap: INVALID_ARGUMENT from the worker,
    in the validator's words; a large message within the caps is served."""
    import grpc

    from pagedserve.v1 import generation_pb2_grpc as pb_grpc
    from scheduler_svc.front.grpc.call_gate import LARGE_MESSAGE_BYTES
    from scheduler_svc.front.input import parse_pool
    from testing.grpc_fakes import FakeEngine, ServerThread, make_tokenizer

    engine = FakeEngine(make_tokenizer(), max_model_len=64)
    engine.ready = True
    srv = ServerThread(engine)
    handled = lambda: parse_pool._workers[srv.loop].handled  # noqa: E731  (this server's worker)
    try:
        with grpc.insecure_channel(srv.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            req = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=1, stop=["ab"] * 100_000))
            assert req.ByteSize() > LARGE_MESSAGE_BYTES
            with pytest.raises(grpc.RpcError) as e:
                list(stub.Generate(req, timeout=20))
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details() == "sampling.stop: at most 64 entries as sent, duplicates included (got 100000)"
            padded = pb.GenerateRequest(prompt="hi " * 100_000, sampling=pb.SamplingParams(max_tokens=2))
            assert padded.ByteSize() > LARGE_MESSAGE_BYTES
            with pytest.raises(grpc.RpcError) as e:  # within the counts: the front parses it, and the
                list(stub.Generate(padded, timeout=20))  # validator refuses the prompt from its length
            assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "maximum context length is 64 tokens" in e.value.details()
            assert handled() == 2
    finally:
        srv.stop()


def test_a_large_body_is_refused_unread_while_the_worker_queue_is_full():
    """503 with Retry-After from the Content-Length alone, and the connection closed, so a flood
    past the queue costs the front no body reads; a small body is still served."""
    import socket

    from testing.grpc_fakes import FakeEngine, make_tokenizer
    from testing.http_fakes import HttpThread

    engine = FakeEngine(make_tokenizer(), max_model_len=4096)
    engine.ready = True
    srv = HttpThread(engine)
    worker = ParseWorker()
    srv.front.parser = BodyParser(worker=worker)
    worker.queued = worker.queue_bytes  # as a flood holds it
    try:
        with socket.create_connection(("127.0.0.1", srv.server.port), timeout=5) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % (300 << 10))
            reply = b""
            while chunk := sock.recv(65536):  # the server closes it: the body is never read
                reply += chunk
        head = reply.split(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 503") and b"retry-after: 1" in head and b"connection: close" in head
        status, _ = srv.request("POST", "/v1/completions", {"model": "tiny-test", "prompt": "hi", "max_tokens": 2})
        assert status == 200 and worker.starts == 0
    finally:
        srv.stop()


def test_a_large_batch_of_token_ids_is_read_and_validated_off_the_loop():
    """64 prompts of token ids filling the body cap at 131,072 tokens (within every count cap):
    read and validated in this thread they take over 100 ms of Python; served, the front's loop
    never stalls for half of that."""
    import threading

    from testing.grpc_fakes import FakeEngine, make_tokenizer
    from testing.http_fakes import HttpThread

    engine = FakeEngine(make_tokenizer(), max_model_len=131072)
    engine.ready = True
    srv = HttpThread(engine)
    ids = [i % 10 for i in range(24_000)]  # 3.07 MB in all
    doc = {"model": "tiny-test", "prompt": [ids] * 64, "max_tokens": 1}
    req = CompletionRequest(prompt=[ids] * 64, max_tokens=1)
    start = time.perf_counter()
    srv.front._completion_requests(req, None, engine.info)
    inline = time.perf_counter() - start
    gaps: list[float] = []
    done = threading.Event()

    async def ticker():
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    try:
        srv.request("POST", "/v1/completions", {"model": "tiny-test", "prompt": "x" * 300_000, "max_tokens": 1})
        tick = asyncio.run_coroutine_threadsafe(ticker(), srv.loop)
        status, _ = srv.request("POST", "/v1/completions", msgspec.json.encode(doc))
        done.set()
        tick.result(5)
    finally:
        srv.stop()
    assert status == 200
    print(f"inline {inline * 1e3:.0f} ms; the loop's longest stall {max(gaps) * 1e3:.1f} ms")
    assert max(gaps) < inline / 2, (max(gaps), inline)
