"""The hub's ROUTER socket on the event loop, without pyzmq's asyncio layer.

``zmq.asyncio`` wraps every send and receive in a future and re-derives the
socket's poll state through ``enum.Flag`` arithmetic each time: about two dozen
enum operations and several future callbacks per step, which was a third of the
scheduler's CPU per step with one running sequence (a fixed cost paid on every
step of every executor). Here a send is one non-blocking ``send_multipart`` (a
peer whose pipe is full fails it), and a receive is a non-blocking
``recv_multipart`` that only waits when nothing is queued.

On a CURVE server (``peer_keys``) each receive also records which key sent the
message (:meth:`RouterSocket.peer_key`), so that a handshake is bound to the key
its connection authenticated with, never to one the peer names.

ZeroMQ's file descriptor is edge-like: it signals that the socket's state may
have changed, and is reset by whatever operation reads that state (any send or
receive, or ``EVENTS``). So the reader callback reads ``EVENTS`` (which also
clears the signal), and after every send a waiting receiver is woken if a
message has become readable meanwhile: the send may have consumed the signal
of a message that arrived while it ran.
"""

from __future__ import annotations

import asyncio

import zmq

# Plain ints: pyzmq's constants are enum.Flag members, and arithmetic on them is what this avoids.
_NOBLOCK, _EVENTS, _POLLIN = int(zmq.NOBLOCK), int(zmq.EVENTS), int(zmq.POLLIN)


class RouterSocket:
    """A bound ROUTER socket written from one asyncio loop and read by one task of it."""

    def __init__(self, sock: zmq.Socket, loop: asyncio.AbstractEventLoop, peer_keys: bool = False) -> None:
        """``peer_keys``: the socket is a CURVE server; record which key sent each message (:meth:`peer_key`)."""
        self.sock, self._loop = sock, loop
        self._waiter: asyncio.Future | None = None
        self._fd = sock.getsockopt(zmq.FD)
        self._peer_keys = peer_keys
        self._last: tuple[bytes, bytes | None] = (b"", None)  # (routing id, CURVE key) of the last message
        loop.add_reader(self._fd, self._on_signal)

    async def recv_multipart(self) -> list[bytes]:
        """The next message's frames; waits (without polling) until one is queued."""
        while True:
            if self.sock.getsockopt(_EVENTS) & _POLLIN:  # (cheaper than catching zmq.Again)
                if self._peer_keys:
                    return self._recv_keyed()
                return self.sock.recv_multipart(_NOBLOCK)
            self._waiter = self._loop.create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def _recv_keyed(self) -> list[bytes]:
        # Only the routing id frame is received as a Frame: it carries the connection's metadata, whose
        # ZAP User-Id is the z85 public key the connection authenticated with (pyzmq's default).
        head = self.sock.recv(_NOBLOCK, copy=False)
        frames = [head.bytes, *self.sock.recv_multipart(_NOBLOCK)] if head.more else [head.bytes]
        self._last = (frames[0], head.get("User-Id").encode())
        return frames

    def peer_key(self, identity: bytes) -> bytes | None:
        """The CURVE public key (z85) of the connection that sent the message received last, which
        must be ``identity``'s (so a caller cannot bind the key of another message); None on a
        socket without CURVE."""
        if not self._peer_keys:
            return None
        if self._last[0] != identity:
            raise RuntimeError(f"peer_key({identity[:64]!r}) asked after a message of another peer was received")
        return self._last[1]

    def send_multipart(self, frames: list[bytes]) -> None:
        """Queue a message; ZMQError when it cannot be: EHOSTUNREACH (the peer is gone:
        ROUTER_MANDATORY) or EAGAIN (the peer's pipe is full: thousands of messages it has not
        read, since at most two plans and a heartbeat a second are outstanding; a peer that stops
        reading fails here instead of holding up the caller, and with it every other executor)."""
        try:
            self.sock.send_multipart(frames, _NOBLOCK)
        finally:  # a send, failed or not, may have consumed the signal of a message that arrived
            if not self.sock.closed:
                self._wake_if_readable()

    def close(self) -> None:
        self._loop.remove_reader(self._fd)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.cancel()
        self.sock.close(linger=0)

    def _on_signal(self) -> None:
        self._wake_if_readable()

    def _wake_if_readable(self) -> None:
        # Reading EVENTS processes libzmq's pending commands and resets the descriptor's signal.
        w = self._waiter
        if self.sock.getsockopt(_EVENTS) & _POLLIN and w is not None and not w.done():
            w.set_result(None)
