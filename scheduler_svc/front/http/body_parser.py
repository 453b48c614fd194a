"""JSON request bodies read within their bounds (:func:`read_body`) and decoded without holding the
front's event loop.

A small body (``LARGE_BODY_BYTES`` or less, nearly every request) is decoded at once: at most a
few milliseconds, whatever it holds. A larger one goes to the parse worker
(input/parse_pool.py), a process of its own, which decodes it and checks the counts inside it
against the model's caps (guards/request_caps.py); a body over a cap is refused there (400), and
one within them comes back as msgpack, rebuilt here in a few milliseconds at most. msgspec holds
the GIL for a whole decode, so a worker thread would not do: a 43 ms decode in
``asyncio.to_thread`` stopped the loop for 47 ms.

What the worker takes is bounded (parse_pool.py): past its queue of bytes, or after waiting for
its turn, a request gets 503 with ``Retry-After``, its body dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import Any

import msgspec
from starlette.requests import ClientDisconnect, Request

from scheduler_svc.front.api_errors import ApiError
from scheduler_svc.front.guards.request_caps import RequestCaps, check_openai, error_from_wire
from scheduler_svc.front.http.openai_types import decode
from scheduler_svc.front.input.offload import trim_soon
from scheduler_svc.front.input.parse_pool import (
    OK,
    REFUSED,
    RETRY_AFTER_S,
    ParserBusy,
    ParseWorker,
    shared_worker,
)
from scheduler_svc.front.input.parse_worker import KINDS

log = logging.getLogger(__name__)

LARGE_BODY_BYTES = 256 << 10  # about 4 ms of the slowest JSON to decode (one-letter strings)
_KIND_NAMES = {kind: name for name, kind in KINDS.items()}
BUSY = "server_busy"


class BodyParser:
    def __init__(self, large_bytes: int = LARGE_BODY_BYTES, worker: ParseWorker | None = None) -> None:
        self.large_bytes = large_bytes
        self._worker = worker  # None: the process's shared worker (parse_pool.shared_worker)
        self.offloaded = 0  # bodies the worker decoded (tests and metrics)

    @property
    def worker(self) -> ParseWorker:
        if self._worker is None:
            self._worker = shared_worker()
        return self._worker

    def check_room(self, content_length: int) -> None:
        """503 (``server_busy``) before a large body is read when the worker's queue cannot take it
        now: the client is answered and its connection closed, its body never read."""
        if content_length > self.large_bytes:
            try:
                self.worker.check_room(content_length)
            except ParserBusy as e:
                raise _busy(e) from None

    async def decode(self, body: bytes, kind: type[msgspec.Struct], caps: RequestCaps) -> Any:
        """``body`` as ``kind`` (openai_types.decode: its 400s; a large one's counts within ``caps``)."""
        if len(body) <= self.large_bytes:
            req = decode(body, kind)
            check_openai(req, caps)  # the same refusals, whichever path a body takes
            return req
        try:
            status, payload = await self.worker.run(_KIND_NAMES[kind], caps.to_wire(), body)
        except ParserBusy as e:
            raise _busy(e) from None
        finally:
            trim_soon()  # the body's pages, and the reply's, back to the OS
        self.offloaded += 1
        if status == OK:
            return msgspec.msgpack.decode(payload, type=kind)
        if status == REFUSED:
            raise error_from_wire(payload)
        log.error("the parse worker failed on a request body (%s); decoding it here", payload)
        return decode(body, kind)


def _busy(e: ParserBusy) -> ApiError:
    return ApiError(503, f"the server is decoding other large requests ({e}); retry shortly",
                    code=BUSY, headers={"retry-after": str(RETRY_AFTER_S)})


def check_media_type(headers: Mapping[str, str]) -> None:
    """415 (``unsupported_media_type``) for a body that is not plain JSON, before it is read.
    A missing Content-Type is taken as JSON (clients that send none mean it); any other type than
    JSON, such as curl's default for ``-d`` (form-encoded), is refused rather than decoded as JSON
    by guess. A compressed body is refused: decompressing it would take memory its length does not bound."""
    ctype = headers.get("content-type")
    if ctype is not None:
        media = ctype.split(";", 1)[0].strip().lower()
        if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
            raise ApiError(415, f"Content-Type: only application/json is accepted (got {ctype[:60]!r}; "
                                "with curl, pass -H 'Content-Type: application/json')",
                           code="unsupported_media_type", param="content-type")
    encoding = headers.get("content-encoding")
    if encoding is not None and encoding.strip().lower() not in ("", "identity"):
        raise ApiError(415, f"Content-Encoding: only an uncompressed body is accepted (got {encoding[:40]!r})",
                       code="unsupported_media_type", param="content-encoding")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, rejected before reading when it is not JSON (415) or its Content-Length is over
    ``limit`` (413), or as soon as it passes ``limit``; 408 unless it has all arrived within ``timeout_s``."""
    check_media_type(request.headers)
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise ApiError(413, f"request body: at most {limit} bytes (Content-Length: {length[:20]})",
                       code="request_too_large")
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, f"request body: at most {limit} bytes", code="request_too_large")
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"request body: not received within {timeout_s:g}s (received {size} bytes)",
                       code="request_timeout") from None
    except ClientDisconnect:  # gone mid-upload: counted as cancelled, not an internal error
        raise ApiError(499, "the client closed the connection while sending the request",
                       code="client_closed_request") from None
    return b"".join(chunks)
