"""``--stream-interval``: a request's outputs merged into fewer messages, nothing lost or reordered.

``coalesce`` is checked against random streams (several choices, logprobs, merged steps, a
finish); then each front is run with the option, against its own run without it.
"""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from grpc_fakes import FakeEngine, ServerThread, make_tokenizer
from http_fakes import HttpThread
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from scheduler_svc.api_types import (
    ChoiceDelta,
    FinishReason,
    RequestFailed,
    RequestOutput,
    TokenLogprob,
    Usage,
)
from scheduler_svc.stream_interval import coalesce, merge_outputs


async def _source(outs: list[RequestOutput], error: Exception | None = None, closed: list | None = None):
    try:
        for out in outs:
            yield out
        if error is not None:
            raise error
    finally:
        if closed is not None:
            closed.append(True)


def _per_choice(outs: list[RequestOutput]) -> dict[int, tuple[str, list[int], list[int], list[int]]]:
    """Per choice: text, token ids, logprob token ids, finish reasons (in order)."""
    got: dict[int, tuple[str, list[int], list[int], list[int]]] = {}
    for out in outs:
        for c in out.choices:
            text, ids, lps, reasons = got.get(c.index, ("", [], [], []))
            got[c.index] = (text + c.text, ids + c.token_ids, lps + [lp.token_id for lp in c.logprobs],
                            reasons + ([c.finish_reason] if c.finish_reason != FinishReason.UNSPECIFIED else []))
    return got


@st.composite
def streams(draw) -> list[RequestOutput]:
    """One request's outputs: each step advances some of its choices by 1-3 tokens; the last
    output finishes every choice."""
    n = draw(st.integers(1, 3))
    steps = draw(st.integers(1, 12))
    outs, tok = [], 10
    for step in range(steps):
        last = step == steps - 1
        choices = []
        # Some choices advance each step (at least one: the engine streams no empty outputs).
        advancing = range(n) if last else draw(st.sets(st.integers(0, n - 1), min_size=1))
        for index in sorted(advancing):
            ids = list(range(tok, tok + draw(st.integers(1, 3))))
            tok += len(ids)
            lps = [TokenLogprob(i, -0.5, [], []) for i in ids] if draw(st.booleans()) else []
            choices.append(ChoiceDelta(index, "".join(f"<{i}>" for i in ids), ids, lps,
                                       FinishReason.LENGTH if last else FinishReason.UNSPECIFIED))
        outs.append(RequestOutput("r", choices, Usage(3, tok - 10, 0) if last else None, finished=last))
    return outs


@settings(max_examples=150, deadline=None)
@given(outs=streams(), interval=st.integers(1, 5))
def test_coalescing_keeps_every_token_in_order_and_holds_at_most_interval_tokens(outs, interval):
    async def run():
        return [o async for o in coalesce(_source(outs), interval)]

    merged = asyncio.run(run())
    assert _per_choice(merged) == _per_choice(outs)
    assert merged[0] is outs[0]  # the first output is sent as it came: time to first token unchanged
    assert merged[-1].finished and merged[-1].usage == outs[-1].usage
    assert not any(m.finished for m in merged[:-1])
    counts = [max((len(c.token_ids) for c in m.choices), default=0) for m in merged]
    # Between the first and the last message, each went out only once one choice reached the
    # interval (and with interval 1, every output went out on its own).
    assert all(c >= interval for c in counts[1:-1])
    if interval == 1:
        assert len(merged) == len(outs)


def test_an_error_first_releases_the_held_tokens():
    outs = [RequestOutput("r", [ChoiceDelta(0, t, [i])]) for i, t in enumerate("abc")]

    async def run():
        got = []
        with pytest.raises(RequestFailed, match="executor died"):
            async for o in coalesce(_source(outs, RequestFailed("executor died")), 10):
                got.append(o)
        return got

    got = asyncio.run(run())
    assert [c.text for o in got for c in o.choices] == ["a", "bc"]  # "bc" was held when it failed


def test_closing_the_coalesced_stream_closes_the_engine_stream():
    outs = [RequestOutput("r", [ChoiceDelta(0, t, [i])]) for i, t in enumerate("abcdef")]

    async def run():
        closed: list = []
        stream = coalesce(_source(outs, closed=closed), 2)
        assert (await anext(stream)).choices[0].text == "a"
        await stream.aclose()
        return closed

    assert asyncio.run(run()) == [True]


def test_merging_one_output_returns_it_and_keeps_the_last_usage():
    a = RequestOutput("r", [ChoiceDelta(0, "x", [1])])
    assert merge_outputs([a]) is a
    b = RequestOutput("r", [ChoiceDelta(1, "y", [2], finish_reason=FinishReason.STOP)], Usage(1, 2, 0), True)
    m = merge_outputs([a, b])
    assert [(c.index, c.text, c.finish_reason) for c in m.choices] == [(0, "x", FinishReason.UNSPECIFIED),
                                                                     (1, "y", FinishReason.STOP)]
    assert m.finished and m.usage == Usage(1, 2, 0)
    assert a.choices[0].token_ids == [1]  # the inputs are not modified


def test_the_grpc_front_sends_fewer_messages_with_the_same_text():
    engine = FakeEngine(make_tokenizer(), max_model_len=64)
    engine.ready = True
    per_interval = {}
    for interval in (1, 3):
        srv = ServerThread(engine, stream_interval=interval)
        try:
            with grpc.insecure_channel(srv.address) as channel:
                stub = pb_grpc.GenerationStub(channel)
                per_interval[interval] = list(stub.Generate(pb.GenerateRequest(prompt="Hello"), timeout=10))
        finally:
            srv.stop()
    ones, threes = per_interval[1], per_interval[3]
    assert "".join(c.text for r in threes for c in r.choices) == "".join(c.text for r in ones for c in r.choices)
    assert [t for r in threes for c in r.choices for t in c.token_ids] == \
        [t for r in ones for c in r.choices for t in c.token_ids]
    sizes = [sum(len(c.token_ids) for c in r.choices) for r in threes]
    assert sizes[0] == 1 and all(s >= 3 for s in sizes[1:-1]) and len(threes) < len(ones)
    assert threes[-1].usage.completion_tokens == ones[-1].usage.completion_tokens


def test_the_http_front_sends_fewer_events_with_the_same_text():
    engine = FakeEngine(make_tokenizer(), max_model_len=64)
    engine.ready = True
    texts, counts = {}, {}
    for interval in (1, 3):
        srv = HttpThread(engine, stream_interval=interval)
        try:
            status, raw = srv.request("POST", "/v1/completions", {"prompt": "a", "stream": True})
        finally:
            srv.stop()
        assert status == 200
        events = [json.loads(e.removeprefix("data: ")) for e in raw.decode().split("\n\n")
                  if e and e != "data: [DONE]"]
        texts[interval] = "".join(c["text"] for e in events for c in e["choices"])
        counts[interval] = len(events)
    assert texts[3] == texts[1] and counts[3] < counts[1]


def test_the_front_cost_benchmark_streams_every_token(capsys):
    from benchmarks import front_stream_cost

    front_stream_cost.main(["--streams", "4", "--tokens", "6", "--repeats", "1", "--intervals", "1,3"])
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    # 6 tokens: one message each, or 1 + 3 + 2 (the first at once, then held until 3 or the end)
    assert summary["tokens_per_message_interval_1"] == 1.0
    assert summary["tokens_per_message_interval_3"] == 2.0
