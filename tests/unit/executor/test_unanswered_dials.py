"""An executor whose id another executor holds is told so, not left reconnecting in silence."""

from __future__ import annotations

import logging
import time

import pytest
import zmq

from executor_svc.unanswered import WARN_AFTER, UnansweredDials
from testing.stack import free_port

IN_USE = "--executor-id ex0 is probably in use by another executor connected to it"


@pytest.fixture
def ctx():
    c = zmq.Context()
    yield c
    c.destroy(linger=0)


def _router(ctx: zmq.Context) -> tuple[zmq.Socket, str]:
    """The scheduler's socket as it is set up (no ROUTER_HANDOVER)."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    return router, f"tcp://127.0.0.1:{port}"


def _dial(ctx: zmq.Context, dials: UnansweredDials, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"ex0")
    dials.watch(sock)
    sock.connect(endpoint)
    sock.send(b"handshake", zmq.NOBLOCK)
    time.sleep(0.3)  # (the ZeroMQ handshake, on loopback)
    return sock


def test_dials_a_router_takes_but_never_answers_name_the_id(ctx, caplog):
    router, endpoint = _router(ctx)
    first = ctx.socket(zmq.DEALER)
    first.setsockopt(zmq.ROUTING_ID, b"ex0")
    first.connect(endpoint)
    first.send(b"hello")
    assert router.recv_multipart() == [b"ex0", b"hello"]  # the live executor holds the id
    dials = UnansweredDials("ex0")
    for attempt in range(1, WARN_AFTER + 1):
        sock = _dial(ctx, dials, endpoint)
        assert not router.poll(100)  # libzmq holds the second connection's messages: the scheduler sees nothing
        with caplog.at_level(logging.ERROR):
            dials.silent()
        assert dials.count == attempt
        assert (IN_USE in caplog.text) == (attempt == WARN_AFTER)
        sock.close(linger=0)
    dials.close()


def test_no_scheduler_listening_is_not_blamed_on_the_id(ctx, caplog):
    dials = UnansweredDials("ex0")
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    for _ in range(WARN_AFTER + 1):
        sock = _dial(ctx, dials, endpoint)
        dials.silent()
        sock.close(linger=0)
    assert dials.count == 0 and IN_USE not in caplog.text
    dials.close()


def test_an_answer_starts_the_count_again(ctx):
    router, endpoint = _router(ctx)
    first = ctx.socket(zmq.DEALER)
    first.setsockopt(zmq.ROUTING_ID, b"ex0")
    first.connect(endpoint)
    first.send(b"hello")
    router.recv_multipart()
    dials = UnansweredDials("ex0")
    sock = _dial(ctx, dials, endpoint)
    dials.silent()
    assert dials.count == 1
    dials.answered()
    assert dials.count == 0
    sock.close(linger=0)
    dials.close()
