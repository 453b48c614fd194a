"""HTTP errors in OpenAI's shape, and the one place engine and validation errors get HTTP statuses.

    ValidationError, bad JSON, unsupported field -> 400 invalid_request_error (param: the field)
    body over --http-max-body-bytes -> 413       unknown model -> 404 model_not_found
    body not received within --http-body-timeout-s -> 408
    no or unknown API key -> 401                 QUEUE_FULL -> 429 (Retry-After)
    over --max-concurrent-calls or --max-in-flight-bytes, a peer's failed API keys -> 429 (before the body; Retry-After)
    NO_EXECUTOR, no model yet (Retry-After), shutting down -> 503
    FAILED, anything unexpected -> 500 (this request only; logged)
    (the engine's errors, by ErrorKind: from the table both fronts share, scheduler_svc/front/output/status_codes.py)
    client gone while sending or waiting -> 499 (nginx's "client closed request"; nobody reads it)

The body is ``{"error": {"message", "type", "param", "code"}}``. Each status also has the gRPC
code name the gRPC front would have used, so ``pagedserve:request_rejected_total{code}``
counts both fronts in one vocabulary.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence

from starlette.types import Send

from scheduler_svc.front.api_errors import ApiError, bad_field
from scheduler_svc.front.input.validation import ValidationError
from scheduler_svc.front.output.status_codes import ClientStatus, no_model_message

RETRY_AFTER_S = 1  # calls end, queues drain, executors register: a caller turned away may come back soon


def retry_soon(status: int, message: str, code: str) -> ApiError:
    """A 429 or 503 whose cause passes by itself (the call budget, a full queue, no executor): with
    ``Retry-After``, so that clients back off by the server's hint rather than their own guess."""
    return ApiError(status, message, code=code, headers={"retry-after": str(RETRY_AFTER_S)})


def from_engine(r: ClientStatus) -> ApiError:
    """An engine error's answer (status_codes.py): a full queue (429) or no executor (503) passes soon."""
    if r.http_status in (429, 503):
        return retry_soon(r.http_status, r.message, r.api_code)
    return ApiError(r.http_status, r.message, code=r.api_code)


def no_executor(served_before: bool) -> ApiError:
    """No model to serve: none has registered yet, or (``served_before``) the last executor left."""
    return retry_soon(503, no_model_message(served_before), "no_executor")


def from_validation(e: ValidationError, names: Mapping[str, str]) -> ApiError:
    """The shared validator's error in OpenAI terms.

    The validator names gRPC fields (``sampling.stop[1]``, ``prompt_token_ids[3]``); ``names``
    maps their base name (without ``sampling.`` and indices) to the OpenAI field the client
    sent, and the index stays in the message: ``stop[1]: must not be empty (got '')``.
    """
    field = e.field.removeprefix("sampling.")
    base, bracket, rest = field.partition("[")
    name = names.get(base, base)
    return bad_field(name + bracket + rest, e.detail, code=e.code)


async def send_error(send: Send, err: ApiError, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    """``err`` as a whole response, sent by an ASGI middleware (outside Starlette's exception handlers),
    with its own headers (as the app's handler sends them) and ``headers``."""
    body = json.dumps(err.body()).encode()
    own = [(name.encode(), value.encode()) for name, value in (err.headers or {}).items()]
    await send({"type": "http.response.start", "status": err.status, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()), *own, *headers]})
    await send({"type": "http.response.body", "body": body})
