"""How long a gRPC connection, or a call's request, may hold the server without using it.

Each knob has a ``--grpc-*`` flag (scheduler_svc/entrypoints/service_flags.py) and becomes grpc core channel
arguments here (:func:`server_options`). grpc core ignores arguments it does not know, silently,
so each of these is exercised against a real client in tests/unit/front/test_grpc_connections.py:

- ``handshake_timeout_s``: a new connection must finish its TLS handshake and send HTTP/2's
  preface and SETTINGS within it (grpc.server_handshake_timeout_ms), whatever it trickles.
- ``idle_timeout_s``: a connection with no call in progress gets GOAWAY and is closed after it
  (grpc.max_connection_idle_ms). Only calls count: pings, WINDOW_UPDATEs or SETTINGS sent to
  keep it open do not.
- ``message_timeout_s``: a call's request message must arrive whole within it of the call's
  start (enforced by the call gate, scheduler_svc/front/grpc/call_gate.py: grpc has no such argument).
- ``keepalive_s``: the server pings its peers (grpc.keepalive_time_ms) and closes a connection
  whose ping goes unanswered for a third of it (grpc.keepalive_timeout_ms and
  grpc.http2.ping_timeout_ms), so a vanished client's stream does not run on for ever.
- ``max_connection_age_s``: a connection gets GOAWAY after it (grpc.max_connection_age_ms) so
  clients reconnect and spread over replicas; its calls in progress run to their end (no grace
  limit), new ones go over a new connection.
- ``max_connections`` (0: the open-files limit less the descriptor reserve,
  pagedserve/fd_limits.py): past it grpc core closes a new connection at once
  (grpc.max_allowed_incoming_connections), so its client's calls fail UNAVAILABLE, never a
  process out of descriptors.

A client that pings more often than every 5 minutes without calls is closed after 2 strikes
(grpc.http2.min_ping_interval_without_data_ms, grpc.http2.max_ping_strikes; grpc's defaults,
stated). A call's receive window stays 64 KiB until its message is read (grpc.http2.bdp_probe
off), so what a call pushes before the call gate has reserved room for it stays small. Calls in
progress, however long, are never cut by any of these.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedserve.fd_limits import connection_cap, open_files_limit
from scheduler_svc.front.guards.request_size import request_bytes_for

INFINITE_MS = 2**31 - 1  # grpc core's "no limit" for a millisecond argument (INT_MAX)
MIN_PING_INTERVAL_WITHOUT_DATA_MS = 5 * 60 * 1000
MAX_PING_STRIKES = 2


@dataclass(frozen=True, slots=True)
class GrpcLimits:
    handshake_timeout_s: int = 10  # TLS + HTTP/2 preface and SETTINGS
    idle_timeout_s: int = 60  # a connection without calls
    message_timeout_s: int = 60  # a call's request message, from the call's start
    keepalive_s: int = 60  # ping a quiet connection; unanswered for keepalive_s / 3: closed
    max_connection_age_s: int = 3600  # GOAWAY; calls in progress finish
    max_connections: int = 0  # 0: derived from the open-files limit

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name == "max_connections" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"GrpcLimits.{f.name} must be an integer >= {low} (got {value!r})")


def server_options(limits: GrpcLimits) -> list[tuple[str, int]]:
    """The grpc core arguments that enforce ``limits`` (see the module docstring)."""
    ping_timeout_ms = max(limits.keepalive_s * 1000 // 3, 1)
    return [
        ("grpc.server_handshake_timeout_ms", limits.handshake_timeout_s * 1000),
        ("grpc.max_connection_idle_ms", limits.idle_timeout_s * 1000),
        ("grpc.max_connection_age_ms", limits.max_connection_age_s * 1000),
        ("grpc.max_connection_age_grace_ms", INFINITE_MS),
        ("grpc.keepalive_time_ms", limits.keepalive_s * 1000),
        ("grpc.keepalive_timeout_ms", ping_timeout_ms),
        ("grpc.http2.ping_timeout_ms", ping_timeout_ms),
        ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_WITHOUT_DATA_MS),
        ("grpc.http2.max_ping_strikes", MAX_PING_STRIKES),
        # Without BDP probing the receive window of a call stays HTTP/2's 64 KiB until the call
        # gate reads its message (grpc then opens it to the message's size at once); with it,
        # grpc offers 4 MiB per call up front, buffered before the gate has reserved room for it.
        ("grpc.http2.bdp_probe", 0),
        ("grpc.max_allowed_incoming_connections", connection_cap(limits.max_connections, open_files_limit())),
    ]


# The largest request message gRPC reads (its default, stated): a prompt longer than the model could
# ever take is rejected from its length before tokenizing (validation.py), so this bounds memory.
MAX_REQUEST_BYTES = 4 * 1024 * 1024


def max_receive_bytes(max_positions: int | None) -> int:
    """grpc.max_receive_message_length: what a request to a model of ``max_positions`` (its config's
    longest sequence, known at start: pagedserve/model_dir.py) can need, at most MAX_REQUEST_BYTES.
    grpc core refuses a longer message (RESOURCE_EXHAUSTED) from its 5-byte length prefix, before
    the rest arrives; the call gate then applies the cap of the max_model_len executors registered."""
    return MAX_REQUEST_BYTES if max_positions is None else min(MAX_REQUEST_BYTES, request_bytes_for(max_positions))
