"""``--stream-interval``: a request's outputs held in its mailbox and handed over merged.

``Tracked`` (the engine's per-request mailbox) is driven with random streams (several choices,
logprobs, a finish) and a consumer that sometimes waits and sometimes falls behind; then the
engine is run with the option against its own run without it, and the benchmark that measures
the fronts' cost is checked to stream every token.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine_api import (
    ChoiceDelta,
    EngineError,
    ErrorKind,
    FinishReason,
    GenerationRequest,
    RequestOutput,
    RequestParams,
    TokenLogprob,
    Usage,
)
from scheduler_svc.front.output.deltas import RequestStream, merge_outputs
from scheduler_svc.front.output.mailbox import Tracked
from scheduler_svc.front.output.stream import OutputStream
from testing.grpc_fakes import make_tokenizer
from tests.unit.engine.test_engine import _req, running

TOKENIZER = make_tokenizer()


def _mailbox(interval: int) -> tuple[Tracked, OutputStream]:
    """A request's mailbox and its consumer's stream, as Engine._admit makes them."""
    req = GenerationRequest("r", [5, 6], RequestParams(max_tokens=64))
    t = Tracked(RequestStream(req, TOKENIZER, num_choices=3), interval)
    return t, OutputStream(req, lambda _: t, lambda _: None)


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
@given(outs=streams(), interval=st.integers(1, 5), waits=st.lists(st.booleans(), min_size=1, max_size=8))
def test_held_outputs_keep_every_token_in_order_and_wake_the_consumer_once_per_interval(outs, interval, waits):
    """``waits[i]``: whether the consumer waits when output i is put (else it is busy elsewhere
    and takes what piled up later)."""
    async def run():
        t, stream = _mailbox(interval)
        got, pending = [], None
        for i, out in enumerate(outs):
            if pending is None and waits[i % len(waits)]:
                pending = stream.__anext__()
            t.put(out)
            if pending is not None and pending.done():
                got.append(pending.result())
                pending = None
        if pending is not None:
            got.append(await pending)
        return got + [o async for o in stream]

    got = asyncio.run(run())
    assert _per_choice(got) == _per_choice(outs)
    if waits[0]:
        assert got[0] is outs[0]  # the first output goes as it came: time to first token unchanged
    assert got[-1].finished and got[-1].usage == outs[-1].usage
    assert not any(m.finished for m in got[:-1])
    counts = [max((len(c.token_ids) for c in m.choices), default=0) for m in got]
    # Between the first and the last message, each was released only once one choice reached
    # the interval (a consumer that fell behind gets several releases merged: more, never fewer).
    assert all(c >= interval for c in counts[1:-1])
    if interval == 1 and all(waits):
        assert len(got) == len(outs)


@pytest.mark.parametrize("waiting", [True, False])
def test_an_error_first_releases_the_held_tokens(waiting):
    async def run():
        t, stream = _mailbox(10)
        for i, text in enumerate("abc"):
            t.put(RequestOutput("r", [ChoiceDelta(0, text, [i])]))
            if i == 0:
                assert (await anext(stream)).choices[0].text == "a"
        assert not t.outbox and len(t.held) == 2  # "b", "c": held, the consumer not woken
        pending = stream.__anext__() if waiting else None
        t.put_error(EngineError(ErrorKind.FAILED, "executor died"))
        got = [(await pending).choices[0].text] if waiting else []
        with pytest.raises(EngineError, match="executor died") as raised:
            async for o in stream:
                got.append(o.choices[0].text)
        assert raised.value.kind is ErrorKind.FAILED
        return got

    assert asyncio.run(run()) == ["bc"]  # held when it failed, handed over before the error


def test_a_consumer_waiting_on_held_tokens_is_woken_once_they_reach_the_interval():
    async def run():
        t, stream = _mailbox(3)
        t.put(RequestOutput("r", [ChoiceDelta(0, "a", [1])]))
        assert (await anext(stream)).choices[0].text == "a"
        pending = stream.__anext__()
        t.put(RequestOutput("r", [ChoiceDelta(0, "b", [2]), ChoiceDelta(1, "x", [9])]))
        t.put(RequestOutput("r", [ChoiceDelta(0, "c", [3])]))
        assert not pending.done()  # choice 0 holds 2 tokens, choice 1 holds 1: below 3
        t.put(RequestOutput("r", [ChoiceDelta(0, "d", [4])]))
        out = await pending
        assert [(c.index, c.text, c.token_ids) for c in out.choices] == [(0, "bcd", [2, 3, 4]), (1, "x", [9])]

    asyncio.run(run())


def test_merging_one_output_returns_it_and_keeps_the_last_usage():
    a = RequestOutput("r", [ChoiceDelta(0, "x", [1])])
    assert merge_outputs([a]) is a
    b = RequestOutput("r", [ChoiceDelta(1, "y", [2], finish_reason=FinishReason.STOP)], Usage(1, 2, 0), True)
    m = merge_outputs([a, b])
    assert [(c.index, c.text, c.finish_reason) for c in m.choices] == [(0, "x", FinishReason.UNSPECIFIED),
                                                                     (1, "y", FinishReason.STOP)]
    assert m.finished and m.usage == Usage(1, 2, 0)
    assert a.choices[0].token_ids == [1]  # the inputs are not modified


def test_the_engine_hands_over_fewer_outputs_with_the_same_tokens():
    """The real engine, one fake executor, greedy (so both runs generate the same tokens)."""
    async def collect(engine, rid):
        return [(sum(len(c.token_ids) for c in o.choices), [t for c in o.choices for t in c.token_ids],
                 "".join(c.text for c in o.choices)) async for o in engine.generate(_req(rid, list(range(3, 20)), 11))]

    async def main():
        per_interval = {}
        for interval in (1, 3):
            async with running(TOKENIZER, 1, stream_interval=interval) as (engine, _):
                per_interval[interval] = await collect(engine, "r")
        return per_interval

    got = asyncio.run(asyncio.wait_for(main(), 60))
    ones, threes = got[1], got[3]
    assert [t for _, ids, _ in threes for t in ids] == [t for _, ids, _ in ones for t in ids]
    assert "".join(x for *_, x in threes) == "".join(x for *_, x in ones)
    assert [n for n, *_ in threes] == [1, 3, 3, 3, 1] and len(ones) == 11  # 1 at once, then 3 at a time


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_a_front_over_the_ticking_engine_streams_every_token(api):
    """tier_capacity's intervals phase (testing/ticking_engine.py): every token reaches the clients,
    in the messages the interval makes."""
    from testing.ticking_engine import front_costs

    summary = front_costs(api, [1, 3], streams=4, tokens=6, repeats=1)
    # 6 tokens: one message each, or 1 + 3 + 2 (the first at once, then held until 3 or the end)
    assert summary["tokens_per_message_interval_1"] == 1.0
    assert summary["tokens_per_message_interval_3"] == 2.0


@pytest.mark.parametrize("api", ["grpc", "http"])
def test_the_frameworks_floor_streams_every_token_to_the_fronts_clients(api):
    """tier_capacity's floor (``python -m benchmarks.front_floor``, run as the benchmark runs it)
    serves the calls its load generator (``python -m benchmarks.tier_load``) makes, one message
    per token, so its CPU per token is comparable with a front's."""
    root = Path(__file__).resolve().parents[3]  # (tests/unit/engine/)
    floor = subprocess.Popen([sys.executable, "-m", "benchmarks.front_floor", "--step-ms", "2"], cwd=root,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        ports = json.loads(floor.stdout.readline())
        load = subprocess.run([sys.executable, "-m", "benchmarks.tier_load", "stream", "--api", api, "--target",
                               f"127.0.0.1:{ports[api]}", "--vocab", "100", "--streams", "3", "--tokens", "5"],
                              cwd=root, capture_output=True, text=True, timeout=120)
        assert floor.poll() is None
    finally:
        floor.stdin.close()  # its signal to stop
        floor.wait(10)
    client = json.loads(load.stdout.strip().splitlines()[-1])
    assert client["failed"] == 0 and client["tokens"] == 15
    assert client["messages"] == 15  # one message per token
    assert floor.returncode == 0  # it stops when its stdin closes
