"""What the public fronts require of a caller: API keys and TLS, one set for gRPC and HTTP.

``--api-key-file FILE`` holds one key per line (blank lines and ``#`` comments
ignored), each at least ``MIN_KEY_CHARS`` printable characters without spaces;
a call must then carry ``authorization: Bearer <key>``. Keys are kept
only as SHA-256 digests and compared by digest. Health checks stay open, so
probes need no key. The gRPC front checks keys in its call gate (call_gate.py),
the HTTP front in its middleware (http/auth.py); both rate-limit a peer's failed
attempts (auth_throttle.py). ``--tls-cert-file``/``--tls-key-file`` serve TLS;
``--tls-client-ca-file`` additionally requires client certificates signed by
that CA (mutual TLS).
"""

from __future__ import annotations

import hashlib
import logging
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pagedserve.envargs import read_flag_file

if TYPE_CHECKING:
    import grpc

log = logging.getLogger(__name__)
OPEN_METHODS = ("/grpc.health.v1.Health/",)  # probes carry no credentials and are never shed
MAX_KEY_FILE_BYTES = 1 << 20
MIN_KEY_CHARS = 16  # a short key can be guessed online; e.g. openssl rand -hex 32 gives 64


class ApiKeys:
    """The accepted bearer tokens (as digests)."""

    def __init__(self, keys: Iterable[str]) -> None:
        self._digests = frozenset(_digest(k) for k in keys)
        if not self._digests:
            raise ValueError("--api-key-file: the file holds no key (one per line)")

    @classmethod
    def from_file(cls, path: Path) -> ApiKeys:
        """The keys in ``path``; ValueError naming the flag, the line and the limit if unusable."""
        flag = "--api-key-file"
        data = read_flag_file(path, flag, MAX_KEY_FILE_BYTES)
        try:
            text = data.decode()
        except UnicodeDecodeError:
            raise ValueError(f"{flag}: {path} is not UTF-8 text") from None
        keys = []
        for number, line in enumerate(text.splitlines(), 1):
            key = line.strip()
            if not key or key.startswith("#"):
                continue
            if len(key) < MIN_KEY_CHARS or not key.isprintable() or any(c.isspace() for c in key):
                # (the message never repeats the key: start-up errors end up in logs)
                raise ValueError(f"{flag}: line {number} of {path} is not a usable key: keys must be at least "
                                 f"{MIN_KEY_CHARS} printable characters without spaces (got {len(key)})")
            keys.append(key)
        return cls(keys)

    def authorizes(self, authorization: str | None) -> bool:
        """Whether an ``authorization`` header value (``Bearer <key>``) carries an accepted key."""
        if not authorization:
            return False
        scheme, _, token = authorization.strip().partition(" ")
        return scheme.lower() == "bearer" and _digest(token.strip()) in self._digests


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True, slots=True)
class TlsFiles:
    cert_file: Path
    key_file: Path
    client_ca_file: Path | None = None  # set: clients must present a certificate signed by it

    def uvicorn_options(self) -> dict:
        """The same files as uvicorn's ssl_* keyword arguments (the HTTP front)."""
        opts = {"ssl_certfile": str(self.cert_file), "ssl_keyfile": str(self.key_file)}
        if self.client_ca_file is not None:
            opts.update(ssl_ca_certs=str(self.client_ca_file), ssl_cert_reqs=ssl.CERT_REQUIRED)
        return opts

    def grpc_credentials(self) -> grpc.ServerCredentials:
        import grpc  # here, not at import: an engine core reads these flags and serves no gRPC

        ca = self.client_ca_file.read_bytes() if self.client_ca_file else None
        return grpc.ssl_server_credentials([(self.key_file.read_bytes(), self.cert_file.read_bytes())],
                                           root_certificates=ca, require_client_auth=ca is not None)
