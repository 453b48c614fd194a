"""``Engine.generate``'s stream keeps an async generator's contract (output_stream.py).

The stream is an async iterator whose ``__anext__`` returns a future the fan-out
completes with the output; these tests drive it through the producer's side
(``Tracked.put`` / ``put_error``), with a stand-in admission and abort.
"""

from __future__ import annotations

import asyncio
import gc

import pytest

from pagedserve.engine_api import (
    ChoiceDelta,
    EngineError,
    ErrorKind,
    GenerationRequest,
    RequestOutput,
    RequestParams,
)
from scheduler_svc.front.output.deltas import RequestStream
from scheduler_svc.front.output.mailbox import Tracked
from scheduler_svc.front.output.stream import OutputStream
from testing.grpc_fakes import make_tokenizer


class Admission:
    """Admits (or not) like the engine, and records the aborts."""

    def __init__(self, refuse: Exception | None = None) -> None:
        self.refuse, self.tracked, self.abandoned = refuse, None, []

    def admit(self, req: GenerationRequest) -> Tracked:
        if self.refuse is not None:
            raise self.refuse
        self.tracked = Tracked(RequestStream(req, make_tokenizer(), num_choices=1))
        return self.tracked

    def abandon(self, t: Tracked) -> None:
        self.abandoned.append(t)

    def stream(self) -> OutputStream:
        return OutputStream(GenerationRequest("r", [5, 6], RequestParams(max_tokens=8)), self.admit, self.abandon)

    async def streaming(self) -> OutputStream:
        """A stream admitted and past its first output ("a")."""
        s = self.stream()
        pending = s.__anext__()
        self.tracked.put(_out("a"))
        await pending
        return s


def _out(text: str, finished: bool = False) -> RequestOutput:
    return RequestOutput("r", [ChoiceDelta(0, text, [7])], finished=finished)


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_outputs_arrive_in_order_whether_or_not_the_consumer_waits():
    async def main():
        a = Admission()
        s = a.stream()
        assert a.tracked is None  # admitted at the first __anext__, not when made
        first = s.__anext__()
        t = a.tracked
        assert t is not None and t.waiter is first and not first.done()
        t.put(_out("a"))  # the consumer waits: its own future gets the output
        assert first.done() and not t.outbox
        assert (await first).choices[0].text == "a"
        t.put(_out("b"))  # nobody waits: kept, and handed over together, in order
        t.put(_out("c", finished=True))
        got = [o async for o in s]
        assert [(o.choices[0].text, o.choices[0].token_ids, o.finished) for o in got] == [("bc", [7, 7], True)]
        assert await anext(s, "end") == "end"  # over, and stays over
        assert a.abandoned == [t]  # told once; the engine aborts only a request still running

    _run(main())


def test_an_error_is_raised_where_the_consumer_waits_and_ends_the_stream():
    async def main():
        for waiting in (True, False):
            a = Admission()
            s = await a.streaming()
            nxt = s.__anext__() if waiting else None
            a.tracked.put_error(EngineError(ErrorKind.FAILED, "executor died"))
            with pytest.raises(EngineError, match="executor died") as raised:
                await (nxt if waiting else s.__anext__())
            assert raised.value.kind is ErrorKind.FAILED
            assert await anext(s, "end") == "end"

    _run(main())


def test_a_consumer_that_fell_behind_gets_the_backlog_as_one_output_then_the_error():
    async def main():
        a = Admission()
        s = await a.streaming()
        for text in "bcd":  # the consumer is busy (a slow client): three steps pile up
            a.tracked.put(_out(text))
        a.tracked.put_error(EngineError(ErrorKind.FAILED, "executor died"))
        caught_up = await s.__anext__()
        assert caught_up.choices[0].text == "bcd" and caught_up.choices[0].token_ids == [7, 7, 7]
        with pytest.raises(EngineError, match="executor died") as raised:  # after every token it had
            await s.__anext__()
        assert raised.value.kind is ErrorKind.FAILED
        assert await anext(s, "end") == "end"

    _run(main())


def test_a_request_not_admitted_raises_at_the_first_await():
    async def main():
        a = Admission(refuse=EngineError(ErrorKind.QUEUE_FULL, "3 requests are queued"))
        s = a.stream()
        with pytest.raises(EngineError) as raised:
            async for _ in s:
                pass
        assert raised.value.kind is ErrorKind.QUEUE_FULL
        assert await anext(s, "end") == "end"
        assert a.abandoned == []  # never admitted: nothing to abort

    _run(main())


def test_closing_early_aborts_once_and_ends_the_stream():
    async def main():
        a = Admission()
        s = await a.streaming()
        waiting = s.__anext__()
        await s.aclose()
        await s.aclose()
        assert a.abandoned == [a.tracked]
        with pytest.raises(StopAsyncIteration):  # a consumer waiting meanwhile sees the end
            await waiting
        a.tracked.put(_out("late"))  # the fan-out may still put what the step produced
        assert await anext(s, "end") == "end"  # not handed to a consumer that closed

    _run(main())


def test_a_cancelled_consumer_ends_the_stream_and_loses_nothing_put_meanwhile():
    async def main():
        a = Admission()
        s = a.stream()

        async def consume(got: list) -> None:
            async for out in s:
                got.append(out.choices[0].text)

        got: list[str] = []
        task = asyncio.ensure_future(consume(got))
        await asyncio.sleep(0)
        a.tracked.put(_out("a"))
        await asyncio.sleep(0)
        task.cancel()  # a client disconnect: cancelled while it waits for the next output
        with pytest.raises(asyncio.CancelledError):
            await task
        a.tracked.put(_out("b"))
        assert got == ["a"] and [o.choices[0].text for o in a.tracked.outbox] == ["b"]
        assert await anext(s, "end") == "end"  # as an async generator: cancelled means over
        assert a.abandoned == [a.tracked]

    _run(main())


def test_dropping_an_unclosed_stream_aborts_its_request_on_the_loop():
    async def main():
        a = Admission()
        s = await a.streaming()
        del s
        gc.collect()
        assert a.abandoned == []  # not from the finalizer itself (it may run on any thread)
        await asyncio.sleep(0)
        assert len(a.abandoned) == 1

    _run(main())


def test_two_outstanding_anext_calls_are_refused():
    async def main():
        a = Admission()
        s = a.stream()
        first = s.__anext__()
        with pytest.raises(RuntimeError, match="still awaited"):
            await s.__anext__()
        a.tracked.put(_out("a"))
        assert (await first).choices[0].text == "a"

    _run(main())
