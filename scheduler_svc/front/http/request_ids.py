"""``X-Request-Id`` on every HTTP response: the client's own when it sent a usable one, else a
fresh id, as OpenAI's API (``x-request-id``, which the openai client reads as ``_request_id``)
and vLLM's ``XRequestIdMiddleware`` answer. A client's value is echoed only when it is 1 to 256
visible ASCII characters; anything else gets a fresh id, never an echo of what it sent.

Wrapped around the ASGI ``send`` once per request (``asgi_app._App``), outside every middleware, so
401, 413, 429 and 404 carry it too; a stream's events go past it (``streams.SERVER_SEND``), its
start does not.
"""

from __future__ import annotations

import re
import uuid

from starlette.types import Message, Scope, Send

HEADER = b"x-request-id"  # (ASGI header names are lower-case)
_USABLE = re.compile(rb"[!-~]{1,256}")


def request_id(scope: Scope) -> bytes:
    """The id a response to ``scope``'s request carries."""
    for name, value in scope.get("headers", ()):
        if name == HEADER:
            if _USABLE.fullmatch(value):
                return value
            break
    return uuid.uuid4().hex.encode()


def with_request_id(scope: Scope, send: Send) -> Send:
    """``send``, adding the request's ``X-Request-Id`` to the response's start."""
    rid = request_id(scope)

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), (HEADER, rid)]}
        await send(message)

    return send_with_id
