"""streams.EventStreamResponse on its own: where its messages go, and how it ends."""

from __future__ import annotations

import asyncio

import pytest

from scheduler_svc.front.http import streams

SCOPE = {"type": "http", "asgi": {"spec_version": "2.3"}}


class Source:
    """An event source that records whether it was closed (the engine requests' abort)."""

    def __init__(self, events: int, then_wait: bool = False) -> None:
        self.events, self.then_wait, self.closed = events, then_wait, False

    async def gen(self):
        try:
            for i in range(self.events):
                yield f"data: {i}\n\n".encode()
            if self.then_wait:
                await asyncio.sleep(3600)
        finally:
            self.closed = True


def _never_disconnects():
    async def receive():
        await asyncio.sleep(3600)

    return receive


def test_the_start_goes_through_the_middleware_and_the_events_to_the_server():
    wrapped, server = [], []

    async def via_middleware(message):
        wrapped.append(message["type"])

    async def to_server(message):
        server.append(message.get("body"))

    src = Source(2)
    asyncio.run(streams.EventStreamResponse(src.gen())(SCOPE | {streams.SERVER_SEND: to_server},
                                                       _never_disconnects(), via_middleware))
    assert wrapped == ["http.response.start"]
    assert server == [b"data: 0\n\n", b"data: 1\n\n", b""]
    assert src.closed


def test_a_client_leaving_ends_the_stream_and_closes_its_source_at_once():
    sent = []
    src = Source(1, then_wait=True)

    async def send(message):
        sent.append(message["type"])

    async def main():
        gone = asyncio.Event()

        async def receive():
            await gone.wait()
            return {"type": "http.disconnect"}

        task = asyncio.ensure_future(streams.EventStreamResponse(src.gen())(SCOPE, receive, send))
        while len(sent) < 2:  # the start and the first event went out; the source waits for more
            await asyncio.sleep(0.01)
        gone.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(main())
    assert sent == ["http.response.start", "http.response.body"]  # no end of body: nobody to send it to
    assert src.closed


def test_a_send_failing_as_the_client_is_gone_ends_the_stream_quietly():
    src = Source(3)

    async def send(message):
        if message["type"] == "http.response.body":
            raise OSError("connection reset")  # what a server of ASGI 2.4 does then

    asyncio.run(streams.EventStreamResponse(src.gen())(SCOPE, _never_disconnects(), send))
    assert src.closed


def test_another_error_while_sending_is_the_responses():
    src = Source(3)

    async def send(message):
        if message["type"] == "http.response.body":
            raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        asyncio.run(streams.EventStreamResponse(src.gen())(SCOPE, _never_disconnects(), send))
    assert src.closed


def test_a_failing_receive_ends_the_stream_as_a_disconnect_does():
    src = Source(1, then_wait=True)

    async def send(message):
        pass

    async def receive():
        raise OSError("the connection broke")

    asyncio.run(streams.EventStreamResponse(src.gen())(SCOPE, receive, send))
    assert src.closed
