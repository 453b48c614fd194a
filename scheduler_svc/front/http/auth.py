"""API keys on the HTTP front: the same ``--api-key-file`` as gRPC, checked before any route runs.

A pure ASGI middleware (no per-request task or body buffering): a request to anything but
``/health`` without ``Authorization: Bearer <key>`` of an accepted key gets 401 with OpenAI's
error body, as api.openai.com answers, and counts against its peer (the client's IP address):
a peer past its failed attempts gets 429 with ``Retry-After`` and its key is not checked
(scheduler_svc/front/guards/auth_throttle.py). Either way the body is never read.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from scheduler_svc.front.api_errors import ApiError
from scheduler_svc.front.guards.auth_throttle import AuthThrottle, peer_of_host
from scheduler_svc.front.guards.security import ApiKeys
from scheduler_svc.front.http.error_responses import send_error
from scheduler_svc.telemetry.metrics import Metrics

OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})  # probes and scrapes carry no credentials, are never shed
AUTH_THROTTLED = "auth_throttled"  # the shed reason counted in metrics


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: ApiKeys, throttle: AuthThrottle | None = None,
                 metrics: Metrics | None = None) -> None:
        self.app, self.keys, self.throttle, self.metrics = app, keys, throttle, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        client = scope.get("client")
        peer = peer_of_host(client[0] if client else None)
        wait = self.throttle.wait_s(peer) if self.throttle is not None else 0.0
        if wait:
            self._count(AUTH_THROTTLED)
            await send_error(send, ApiError(429, f"too many failed API-key attempts from {peer}; retry in "
                                                 f"{wait:.0f}s", code="too_many_failed_api_keys"),
                             [(b"retry-after", str(max(1, round(wait))).encode())])
            return
        if self.keys.authorizes(_authorization(scope)):
            await self.app(scope, receive, send)
            return
        if self.throttle is not None:
            self.throttle.failed(peer)
        self._count(None)
        await send_error(send, ApiError(401, "missing or unknown API key: send 'Authorization: Bearer <key>'",
                                        code="invalid_api_key"), [(b"www-authenticate", b'Bearer realm="pagedserve"')])

    def _count(self, shed_reason: str | None) -> None:
        if self.metrics is None:
            return
        if shed_reason is not None:
            self.metrics.on_shed(shed_reason)
        self.metrics.on_rejected("RESOURCE_EXHAUSTED" if shed_reason else "UNAUTHENTICATED")


def _authorization(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value.decode("latin-1")
    return None
