"""RouterSocket: the hub's ROUTER on the event loop without pyzmq's asyncio layer.

ZeroMQ's descriptor only signals a change; whatever reads the socket's state consumes the
signal. A send must therefore not leave a message that arrived meanwhile unread until the
next one comes (a step's result would wait for the next heartbeat, a second later)."""

from __future__ import annotations

import asyncio
import time

import zmq

from pagedserve.wire.router_socket import RouterSocket


def _pair(ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
    router = zmq.Socket(ctx, zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, b"peer")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return router, dealer


def test_messages_flow_both_ways_and_one_arriving_during_a_send_is_not_missed():
    async def scenario() -> None:
        ctx = zmq.Context()
        router, dealer = _pair(ctx)
        rs = RouterSocket(router, asyncio.get_running_loop())
        try:
            dealer.send(b"hello")
            assert await asyncio.wait_for(rs.recv_multipart(), 5) == [b"peer", b"hello"]
            rs.send_multipart([b"peer", b"welcome"])
            assert dealer.poll(5000) and dealer.recv() == b"welcome"

            waiting = asyncio.create_task(rs.recv_multipart())
            await asyncio.sleep(0.05)  # the receiver waits on the descriptor
            dealer.send(b"result")
            time.sleep(0.1)  # (the loop does not run: the message is queued, its signal pending)
            rs.send_multipart([b"peer", b"next plan"])  # reads the socket's state first
            assert await asyncio.wait_for(waiting, 0.5) == [b"peer", b"result"]

            for i in range(200):  # many at once: each is received, in order
                dealer.send(b"%d" % i)
            assert [(await rs.recv_multipart())[1] for _ in range(200)] == [b"%d" % i for i in range(200)]
        finally:
            rs.close()
            dealer.close()
            ctx.term()

    asyncio.run(scenario())


def test_sending_to_a_vanished_peer_raises():
    async def scenario() -> None:
        ctx = zmq.Context()
        router, dealer = _pair(ctx)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        rs = RouterSocket(router, asyncio.get_running_loop())
        try:
            try:
                rs.send_multipart([b"nobody", b"x"])
            except zmq.ZMQError as exc:
                assert exc.errno == zmq.EHOSTUNREACH
            else:
                raise AssertionError("a send to an unknown routing id must fail")
        finally:
            rs.close()
            dealer.close()
            ctx.term()

    asyncio.run(scenario())


def test_a_peer_that_stops_reading_fails_the_send_instead_of_blocking_it():
    """The hub sends every executor's heartbeats from one loop: a send that waited for a peer
    which never reads would hold up all the others."""
    async def scenario() -> None:
        ctx = zmq.Context()
        router = zmq.Socket(ctx, zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        router.setsockopt(zmq.SNDHWM, 1)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVHWM, 1)
        dealer.setsockopt(zmq.IDENTITY, b"stalled")
        dealer.connect(f"tcp://127.0.0.1:{port}")
        rs = RouterSocket(router, asyncio.get_running_loop())
        try:
            dealer.send(b"hello")  # registers its routing id; it never reads anything
            assert await asyncio.wait_for(rs.recv_multipart(), 5) == [b"stalled", b"hello"]
            big = b"x" * (1 << 16)
            started = time.monotonic()
            try:
                for _ in range(100_000):  # the kernel's socket buffers fill first, then the pipe
                    rs.send_multipart([b"stalled", big])
                    await asyncio.sleep(0)  # (libzmq's I/O thread moves queued frames to the kernel)
            except zmq.Again:
                pass
            else:
                raise AssertionError("sends to a peer that never reads kept succeeding")
            assert time.monotonic() - started < 30
        finally:
            rs.close()
            dealer.close()
            ctx.term()

    asyncio.run(scenario())
