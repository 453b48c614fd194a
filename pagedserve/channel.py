"""A gRPC channel to a pagedserve server with its credentials: TLS (optionally mutual) and an API key.

Used by the ``pagedserve`` CLI and ``pagedserve-bench``. The key travels as
``authorization: Bearer <key>`` metadata on every call (the server's health
service needs none).
"""

from __future__ import annotations

import collections
from pathlib import Path

import grpc


class _Call(collections.namedtuple("_Call", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                             "compression")), grpc.ClientCallDetails):
    pass


class _BearerKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, key: str) -> None:
        self._header = ("authorization", f"Bearer {key}")

    def _details(self, d: grpc.ClientCallDetails) -> _Call:
        return _Call(d.method, d.timeout, [*(d.metadata or ()), self._header], d.credentials,
                     getattr(d, "wait_for_ready", None), getattr(d, "compression", None))

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)


def open_channel(server: str, api_key: str | None = None, tls_ca: Path | None = None,
                 tls_cert: Path | None = None, tls_key: Path | None = None) -> grpc.Channel:
    """Plaintext unless a CA (or a client certificate) is given; mutual TLS with cert and key."""
    if tls_ca or tls_cert or tls_key:
        creds = grpc.ssl_channel_credentials(
            root_certificates=tls_ca.read_bytes() if tls_ca else None,
            private_key=tls_key.read_bytes() if tls_key else None,
            certificate_chain=tls_cert.read_bytes() if tls_cert else None)
        channel = grpc.secure_channel(server, creds)
    else:
        channel = grpc.insecure_channel(server)
    return grpc.intercept_channel(channel, _BearerKey(api_key)) if api_key else channel
