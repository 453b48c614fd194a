"""API keys on the HTTP front: the same ``--api-key-file`` as gRPC, checked before any route runs.

A pure ASGI middleware (no per-request task or body buffering): a request to
anything but ``/health`` without ``Authorization: Bearer <key>`` of an accepted
key gets 401 with OpenAI's error body, as api.openai.com answers; its body is
never read.
"""

from __future__ import annotations

import json
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from scheduler_svc.security import ApiKeys

OPEN_PATHS = frozenset({"/health"})  # probes carry no credentials
_DENIED = json.dumps({"error": {
    "message": "missing or unknown API key: send 'Authorization: Bearer <key>'",
    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: ApiKeys, on_denied: Callable[[], None] = lambda: None) -> None:
        self.app, self.keys, self.on_denied = app, keys, on_denied

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or self.keys.authorizes(_authorization(scope)):
            await self.app(scope, receive, send)
            return
        self.on_denied()
        await send({"type": "http.response.start", "status": 401, "headers": [
            (b"content-type", b"application/json"), (b"content-length", str(len(_DENIED)).encode()),
            (b"www-authenticate", b'Bearer realm="pagedserve"')]})
        await send({"type": "http.response.body", "body": _DENIED})


def _authorization(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return value.decode("latin-1")
    return None
