"""A raw HTTP/2 peer for the gRPC connection tests: the frames a hostile client would send by hand.

grpc's own client cannot trickle bytes, stall a handshake or leave pings unanswered, so these
tests speak HTTP/2 over a plain socket: the client preface, SETTINGS, HEADERS (HPACK literals
without Huffman coding or indexing), DATA, WINDOW_UPDATE and PING, and a reader that waits for
the server to close the connection.
"""

from __future__ import annotations

import socket
import struct
import time

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, SETTINGS, PING, GOAWAY, WINDOW_UPDATE = 0x0, 0x1, 0x4, 0x6, 0x7, 0x8
END_STREAM, END_HEADERS, ACK = 0x1, 0x4, 0x1


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def _literal(name: str, value: str) -> bytes:
    """An HPACK "literal header field without indexing, new name" (lengths < 127 bytes)."""
    n, v = name.encode(), value.encode()
    return b"\x00" + bytes([len(n)]) + n + bytes([len(v)]) + v


def grpc_headers(path: str, stream: int = 1, end_stream: bool = False) -> bytes:
    block = b"".join(_literal(k, v) for k, v in ((":method", "POST"), (":scheme", "http"), (":path", path),
                                                  (":authority", "localhost"), ("content-type", "application/grpc"),
                                                  ("te", "trailers")))
    return frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), stream, block)


def grpc_message(payload: bytes, stream: int = 1, end_stream: bool = True) -> bytes:
    """One gRPC length-prefixed message (uncompressed) in one DATA frame."""
    return frame(DATA, END_STREAM if end_stream else 0, stream, b"\x00" + struct.pack(">I", len(payload)) + payload)


def window_update(increment: int = 1, stream: int = 0) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream, struct.pack(">I", increment))


def connect(port: int, host: str = "127.0.0.1", settings: bool = True) -> socket.socket:
    """A TCP connection that has sent the client preface and an empty SETTINGS frame."""
    sock = socket.create_connection((host, port), timeout=10)
    if settings:
        sock.sendall(PREFACE + frame(SETTINGS, 0, 0))
    return sock


def seconds_until_closed(sock: socket.socket, limit_s: float, trickle: bytes = b"", every_s: float = 0.5,
                         ack_settings: bool = True) -> float:
    """Send ``trickle`` every ``every_s`` seconds and read (acknowledging SETTINGS, never PINGs)
    until the server closes the connection: the seconds that took, or ``limit_s`` when it stayed open."""
    start, next_send, buf = time.monotonic(), 0.0, b""
    while (now := time.monotonic() - start) < limit_s:
        if trickle and now >= next_send:
            try:
                sock.sendall(trickle)
            except OSError:
                return time.monotonic() - start
            next_send = now + every_s
        sock.settimeout(min(every_s, 0.1))
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:  # reset
            return time.monotonic() - start
        if not data:
            return time.monotonic() - start
        buf += data
        while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
            size, kind, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
            if kind == SETTINGS and not flags & ACK and ack_settings:
                try:
                    sock.sendall(frame(SETTINGS, ACK, 0))
                except OSError:
                    return time.monotonic() - start
            buf = buf[9 + size:]
    return limit_s


def send_message(sock: socket.socket, payload: bytes, seconds: float, stream: int = 1) -> int:
    """Send ``payload`` as a gRPC message on ``stream`` in DATA frames, as far as the server's flow
    control windows allow within ``seconds``: the message bytes the server let in."""
    message = b"\x00" + struct.pack(">I", len(payload)) + payload
    conn_window = stream_window = 65535  # HTTP/2's initial windows, until SETTINGS / WINDOW_UPDATE say more
    sent, buf, start = 0, b"", time.monotonic()
    while sent < len(message) and time.monotonic() - start < seconds:
        n = min(16384, conn_window, stream_window, len(message) - sent)
        if n > 0:
            flags = END_STREAM if sent + n == len(message) else 0
            sock.sendall(frame(DATA, flags, stream, message[sent:sent + n]))
            sent, conn_window, stream_window = sent + n, conn_window - n, stream_window - n
            continue
        sock.settimeout(0.05)
        try:
            buf += sock.recv(65536)
        except TimeoutError:
            continue
        while len(buf) >= 9 and len(buf) >= 9 + int.from_bytes(buf[:3], "big"):
            size, kind, flags = int.from_bytes(buf[:3], "big"), buf[3], buf[4]
            target, payload_ = int.from_bytes(buf[5:9], "big") & 0x7FFFFFFF, buf[9:9 + size]
            buf = buf[9 + size:]
            if kind == WINDOW_UPDATE:
                increment = int.from_bytes(payload_, "big")
                if target == 0:
                    conn_window += increment
                elif target == stream:
                    stream_window += increment
            elif kind == SETTINGS and not flags & ACK:
                for i in range(0, len(payload_), 6):
                    key, value = struct.unpack(">HI", payload_[i:i + 6])
                    if key == 0x4:  # SETTINGS_INITIAL_WINDOW_SIZE
                        stream_window += value - 65535
                sock.sendall(frame(SETTINGS, ACK, 0))
    return max(0, sent - 5)
