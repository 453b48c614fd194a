"""The HTTP front's share of the process's CallBudget (scheduler_svc/front/guards/admission.py).

A pure ASGI middleware inside the API-key check: each request but ``/health`` takes a slot and
its body's Content-Length before anything reads the body, and gives both back when its response
has ended (streamed to the end, failed, or the client gone). A body without a Content-Length
(chunked) is charged chunk by chunk as the app reads it. Over either cap: 429 with OpenAI's
error body and ``Retry-After``, the body unread (a chunked one: as soon as it passes). A
Content-Length over the body cap (``OpenAIFront.body_cap``) is not charged: the app rejects it
(413) unread.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scheduler_svc.front.api_errors import ApiError
from scheduler_svc.front.guards.admission import CallBudget, Shed, Ticket
from scheduler_svc.front.http.auth import OPEN_PATHS
from scheduler_svc.front.http.error_responses import retry_soon, send_error
from scheduler_svc.telemetry.metrics import Metrics


class AdmissionMiddleware:
    def __init__(self, app: ASGIApp, budget: CallBudget, body_cap: Callable[[], int],
                 metrics: Metrics | None = None) -> None:
        self.app, self.budget, self.body_cap, self.metrics = app, budget, body_cap, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        shed = None
        try:
            ticket = self.budget.enter(declared if declared is not None and declared <= self.body_cap() else 0)
        except Shed as e:
            shed = e
        if shed is not None:
            self._count(shed.reason)
            if self.metrics is not None:
                self.metrics.on_rejected("RESOURCE_EXHAUSTED")
            await send_error(send, _too_much(shed))
            return
        try:
            await self.app(scope, receive if declared is not None else self._charging(receive, ticket), send)
        finally:
            ticket.release()

    def _charging(self, receive: Receive, ticket: Ticket) -> Receive:
        """``receive`` charging each body chunk to ``ticket``: over the cap, the app's read of the
        body raises a 429 (counted as a rejection by the app's error handler)."""

        async def charged() -> Message:
            message = await receive()
            if message["type"] == "http.request":
                try:
                    ticket.charge(len(message.get("body", b"")))
                except Shed as e:
                    self._count(e.reason)
                    raise _too_much(e) from None
            return message

        return charged

    def _count(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.on_shed(reason)


def _too_much(shed: Shed) -> ApiError:
    return retry_soon(429, str(shed), shed.reason)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None
