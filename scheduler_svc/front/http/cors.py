"""CORS for the HTTP API (``--allowed-origins``): which web pages may call it from a browser.

Off unless origins are given: a browser then sends a cross-origin page's requests without the
headers that would let the page read the answer, and refuses its preflights (405). vLLM allows
any origin by default; here that is ``--allowed-origins '*'``, asked for, since any web page could
otherwise drive a server its visitor can reach (one on localhost included) with the visitor's
network position. The middleware is Starlette's, outermost: a preflight (``OPTIONS`` without an
API key, as browsers send it) is answered before the key is checked; the request itself is not.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.middleware import Middleware


@dataclass(frozen=True, slots=True)
class CorsOptions:
    origins: tuple[str, ...]
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False

    def __post_init__(self) -> None:
        if self.credentials and "*" in self.origins:
            # (browsers refuse credentials with a wildcard origin; Starlette would echo any origin instead)
            raise ValueError("--allow-credentials: name the origins (not *) that may send credentials")

    def middleware(self) -> Middleware:
        from starlette.middleware import Middleware  # (the config is read where no HTTP API runs too)
        from starlette.middleware.cors import CORSMiddleware

        # The response's X-Request-Id is readable by the page (its support request names it).
        return Middleware(CORSMiddleware, allow_origins=list(self.origins), allow_methods=list(self.methods),
                          allow_headers=list(self.headers), allow_credentials=self.credentials,
                          expose_headers=["x-request-id"])
