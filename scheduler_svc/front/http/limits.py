"""Bounds on what an HTTP client may send, checked before the shared validator runs.

The port is reachable by anyone who can reach the service: a body is rejected from its
Content-Length before it is read (and while it streams, when there is none), its size is bounded
by what a legitimate request to this model can need (:func:`body_cap`), it must
arrive within a time limit, and the counts that make work proportional to themselves (chat messages, prompts in one
request) are bounded. A connection's time without a request in progress (its TLS handshake, its
wait for a request, a request's head) is bounded by the protocol itself, whatever bytes trickle
in (scheduler_svc/front/http/serve.py), and so is the number of connections a front holds
(:func:`connection_cap`). Built once in ``__main__`` from the ``--http-*`` flags
(scheduler_svc/entrypoints/service_flags.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from pagedserve.fd_limits import CONNECTION_RESERVE  # noqa: F401  (the HTTP front's reserve is this one)
from pagedserve.fd_limits import connection_cap as fd_connection_cap
from scheduler_svc.front.guards.request_size import request_bytes_for


@dataclass(frozen=True, slots=True)
class HttpLimits:
    max_body_bytes: int = 0  # 0: derived from the model's max_model_len (body_cap)
    max_messages: int = 1024  # per chat request
    max_prompts: int = 64  # prompts in one completions request (a batch)
    max_tools: int = 128  # tools in one chat request (OpenAI's own limit)
    body_timeout_s: int = 60  # to receive a whole body: a client trickling one holds a task and its buffer
    head_timeout_s: int = 20  # to send a request's line and headers (and a new connection's first request)
    keep_alive_timeout_s: int = 5  # a connection's wait for its next request, from its last response
    tls_handshake_timeout_s: int = 10  # a new connection's TLS handshake, before its first request's clock
    max_connections: int = 0  # 0: derived from the open-files limit (connection_cap)

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            low = 0 if f.name in DERIVED else 1
            if not isinstance(value, int) or value < low:
                raise ValueError(f"HttpLimits.{f.name} must be an integer >= {low} (got {value!r})")


DERIVED = frozenset({"max_body_bytes", "max_connections"})  # 0 = derived


def body_cap(limits: HttpLimits, max_model_len: int, max_in_flight_bytes: int | None = None) -> int:
    """The largest body a front reads: ``--http-max-body-bytes`` when given, else what a request to
    the model can need (guards/request_size.py, 0 when no model is known yet); never more than the process's request-bytes
    budget (``max_in_flight_bytes``), which must hold any body it accepts."""
    cap = limits.max_body_bytes or request_bytes_for(max_model_len)
    return min(cap, max_in_flight_bytes) if max_in_flight_bytes else cap


def connection_cap(limits: HttpLimits, open_files: int) -> int:
    """The connections a front serves requests on: ``--http-max-connections`` when given, else the
    open-files limit less CONNECTION_RESERVE (at least 16). A connection past it gets 503 (health
    probes excepted, up to the reserve), never a reset from a process out of descriptors."""
    return fd_connection_cap(limits.max_connections, open_files)
