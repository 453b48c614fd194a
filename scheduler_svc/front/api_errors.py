"""A request rejected with an HTTP status and an OpenAI error body, and its gRPC twin.

Raised wherever the OpenAI API's checks run (the HTTP front, tool-call planning); pure Python,
so that what raises it needs no web framework. ``http/error_responses.py`` sends it as a response.
"""

from __future__ import annotations

from typing import Any

GRPC_CODE_OF_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 405: "UNIMPLEMENTED", 408: "DEADLINE_EXCEEDED",
                       413: "INVALID_ARGUMENT", 415: "INVALID_ARGUMENT", 429: "RESOURCE_EXHAUSTED", 499: "CANCELLED", 500: "INTERNAL",
                       503: "UNAVAILABLE"}


_TYPE_OF_STATUS = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error", 405: "invalid_request_error",
                   408: "invalid_request_error", 413: "invalid_request_error", 415: "invalid_request_error", 429: "rate_limit_error",
                   500: "server_error", 503: "service_unavailable_error"}


class ApiError(Exception):
    """A request rejected with an HTTP status and an OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers  # extra response headers (Retry-After on a 503)

    @property
    def grpc_code(self) -> str:
        return GRPC_CODE_OF_STATUS.get(self.status, "UNKNOWN")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": _TYPE_OF_STATUS.get(self.status, "server_error"),
                          "param": self.param, "code": self.code}}


def bad_field(param: str, message: str, code: str = "invalid_value") -> ApiError:
    """A 400 naming the field (``param``) and saying what is wrong with it."""
    return ApiError(400, f"{param}: {message}", param=param.split("[")[0].split(".")[0], code=code)
