"""Bounds on what an HTTP client may send, checked before the shared validator runs.

The port is reachable by anyone who can reach the service: a body is rejected from its
Content-Length before it is read (and while it streams, when there is none), it must
arrive within a time limit, and the counts that make work proportional to themselves (chat messages, prompts in one
request) are bounded. A connection's time without a request in progress (its TLS handshake, its
wait for a request, a request's head) is bounded by the protocol itself, whatever bytes trickle
in (scheduler_svc/front/http/serve.py). Built once in ``__main__`` from the flags (scheduler_svc/entrypoints/service_config.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HttpLimits:
    # A prompt of 128k tokens is ~1 MB as JSON token ids, ~0.5 MB as text: room for a few.
    max_body_bytes: int = 8 << 20
    max_messages: int = 1024  # per chat request
    max_prompts: int = 64  # prompts in one completions request (a batch)
    body_timeout_s: int = 60  # to receive a whole body: a client trickling one holds a task and its buffer
    head_timeout_s: int = 20  # to send a request's line and headers (and a new connection's first request)
    keep_alive_timeout_s: int = 5  # a connection's wait for its next request, from its last response
    tls_handshake_timeout_s: int = 10  # a new connection's TLS handshake, before its first request's clock

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"HttpLimits.{f.name} must be an integer >= 1 (got {value!r})")
