"""What a client is told when the engine ends its request in error, on either front: one table,
keyed by the error's kind, so the two fronts cannot drift.

    ErrorKind       gRPC status          HTTP  OpenAI "code"
    QUEUE_FULL      RESOURCE_EXHAUSTED   429   queue_full
    NO_EXECUTOR     UNAVAILABLE          503   no_executor
    NOT_FOUND       NOT_FOUND            404   model_not_found  (a LoRA adapter not served)
    INVALID         INVALID_ARGUMENT     400   invalid_request  (an executor refused its grammar)
    DEADLINE        DEADLINE_EXCEEDED    408   deadline_exceeded (its client's deadline passed)
    FAILED          INTERNAL             500   request_failed   (this request only; a warning)
    anything else   INTERNAL             500   internal_error   (a bug: logged with its traceback)

The kind is the one the engine core chose (``EngineError.kind``, or ``RequestUpdate.error_kind``
as the front passed it on). The gRPC servicer raises the status, the HTTP front answers the
status with an OpenAI error body; both count ``pagedserve:request_rejected_total{code}`` under
the gRPC name.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from pagedserve.engine_api import EngineError, ErrorKind

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ClientStatus:
    grpc_code: str  # a grpc.StatusCode name
    http_status: int
    api_code: str  # the OpenAI error body's "code"
    message: str


# kind -> (gRPC status, HTTP status, OpenAI code, message prefix)
STATUS_OF_KIND: dict[ErrorKind, tuple[str, int, str, str]] = {
    ErrorKind.QUEUE_FULL: ("RESOURCE_EXHAUSTED", 429, "queue_full", "request queue is full"),
    ErrorKind.NO_EXECUTOR: ("UNAVAILABLE", 503, "no_executor", "no executor available"),
    ErrorKind.FAILED: ("INTERNAL", 500, "request_failed", "request failed"),
    ErrorKind.NOT_FOUND: ("NOT_FOUND", 404, "model_not_found", "no such model"),
    ErrorKind.INVALID: ("INVALID_ARGUMENT", 400, "invalid_request", "invalid request"),
    ErrorKind.DEADLINE: ("DEADLINE_EXCEEDED", 408, "deadline_exceeded", "deadline exceeded"),
}


def no_model_message(served_before: bool) -> str:
    """Why a front has no model to serve (NO_EXECUTOR, on either front): none has registered yet,
    or (``served_before``) the last executor left."""
    return ("no executor is connected now (the last one left); retry once one has registered" if served_before
            else "no executor has registered yet; retry later")


def client_status(e: Exception, request_id: str) -> ClientStatus:
    """What the client is told when ``e`` ends request ``request_id``; logs what needs it."""
    if isinstance(e, EngineError):
        grpc_code, status, code, prefix = STATUS_OF_KIND[e.kind]
        if e.kind is ErrorKind.FAILED:
            log.warning("request %s failed: %s", request_id, e)
        return ClientStatus(grpc_code, status, code, f"{prefix}: {e}")
    log.error("request %s: unexpected engine error", request_id, exc_info=e)
    return ClientStatus("INTERNAL", 500, "internal_error", f"internal error ({type(e).__name__})")
