"""The ASGI application of the HTTP front: its routes, the middleware around them (API keys
outermost, then the process's call budget), the exception handlers that turn every error into an
OpenAI error body, and the request-id wrapper around each response. :func:`build_app` is the one
place it is assembled; the endpoints are app.py's, responses_api.py's, utility_routes.py's and
lora_routes.py's.
"""

from __future__ import annotations

from collections.abc import Sequence

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from scheduler_svc.front.api_errors import ApiError
from scheduler_svc.front.guards.admission import CallBudget
from scheduler_svc.front.http import lora_routes, responses_api, streams
from scheduler_svc.front.http import utility_routes as extras
from scheduler_svc.front.http.app import OpenAIFront, engine_error, json_response
from scheduler_svc.front.http.body_parser import BUSY
from scheduler_svc.front.http.budget_middleware import AdmissionMiddleware
from scheduler_svc.front.http.request_ids import with_request_id
from scheduler_svc.front.input.offload import trim_soon


def build_app(front: OpenAIFront, middleware: Sequence[Middleware] = (), budget: CallBudget | None = None
              ) -> Starlette:
    """The ASGI app. ``middleware`` (outermost first) wraps every route: API keys go there.
    ``budget``: the calls and request bytes the process's fronts share (admission.py), taken
    inside ``middleware``, so a caller without a key never holds any."""
    if budget is not None:
        middleware = [*middleware, Middleware(AdmissionMiddleware, budget=budget, body_cap=front.body_cap,
                                              metrics=front.metrics)]

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, ApiError)
        front._count(exc.grpc_code)
        response = json_response(exc.body(), exc.status)
        response.headers.update(exc.headers or {})
        if exc.status == 413 or exc.code == BUSY:  # a body perhaps unread: the connection closes after this
            response.headers["connection"] = "close"
            trim_soon()
        return response

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        response = json_response(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                  code=code).body(), exc.status_code)
        response.headers.update(exc.headers or {})  # a 405's Allow (RFC 9110): Starlette lists the route's methods
        return response

    async def internal_error(request: Request, exc: Exception) -> Response:
        return json_response(engine_error(exc, "-").body(), 500)

    routes = [
        Route("/health", front.health, methods=["GET"]),
        Route("/ping", front.health, methods=["GET", "POST"]),  # vLLM's (SageMaker's probe): /health's answer
        Route("/metrics", front.prometheus, methods=["GET"]),
        Route("/v1/models", front.models, methods=["GET"]),
        Route("/v1/models/{model:path}", front.models, methods=["GET"]),
        Route("/v1/completions", front.completions, methods=["POST"]),
        Route("/v1/chat/completions", front.chat, methods=["POST"]),
        *responses_api.routes(front),
        *extras.routes(front),
        *(lora_routes.routes(front) if front.lora_updates else []),
    ]
    return _App(routes=routes, middleware=list(middleware),
                exception_handlers={ApiError: api_error, HTTPException: http_error, Exception: internal_error})


class _App(Starlette):
    """Starlette, with the server's own ``send`` in each request's scope: a streamed response's
    events go to it directly (streams.EventStreamResponse); each response gets an X-Request-Id."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope[streams.SERVER_SEND] = send
        await super().__call__(scope, receive, with_request_id(scope, send) if scope["type"] == "http" else send)
