"""How an engine error reaches a client, on either front: one table, so the two cannot drift.

    error           gRPC status          HTTP  OpenAI "code"
    QueueFull       RESOURCE_EXHAUSTED   429   queue_full
    NoExecutor      UNAVAILABLE          503   no_executor
    RequestFailed   INTERNAL             500   request_failed   (this request only; a warning)
    anything else   INTERNAL             500   internal_error   (a bug: logged with its traceback)

The gRPC servicer raises the status, the HTTP front answers the status with an OpenAI error
body; both count ``pagedserve:request_rejected_total{code}`` under the gRPC name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedserve.engine_api import NoExecutor, QueueFull, RequestFailed

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Refusal:
    grpc_code: str  # a grpc.StatusCode name
    http_status: int
    api_code: str  # the OpenAI error body's "code"
    message: str


# (error class, gRPC status, HTTP status, OpenAI code, message prefix)
KNOWN = (
    (QueueFull, "RESOURCE_EXHAUSTED", 429, "queue_full", "request queue is full"),
    (NoExecutor, "UNAVAILABLE", 503, "no_executor", "no executor available"),
    (RequestFailed, "INTERNAL", 500, "request_failed", "request failed"),
)


def refusal(e: Exception, request_id: str) -> Refusal:
    """What the client is told when ``e`` ends request ``request_id``; logs what needs it."""
    for kind, grpc_code, status, code, prefix in KNOWN:
        if isinstance(e, kind):
            if kind is RequestFailed:
                log.warning("request %s failed: %s", request_id, e)
            return Refusal(grpc_code, status, code, f"{prefix}: {e}")
    log.error("request %s: unexpected engine error", request_id, exc_info=e)
    return Refusal("INTERNAL", 500, "internal_error", f"internal error ({type(e).__name__})")
