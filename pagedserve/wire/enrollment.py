"""Enrollment: an executor whose key the scheduler does not list yet proves it may join.

The proof is an HMAC-SHA256, keyed with an enrollment token, over the
scheduler's public key, the executor's public key and the executor id. The
scheduler recomputes it with the executor key the transport authenticated (ZAP
tells which CURVE key sent the handshake), so a proof is worth nothing with any
other key: replaying one needs that executor's secret key too. A token lets its
holder enroll keys of its own, no more: it is not a key of the link, and it
cannot act as the scheduler (whose secret key only the scheduler holds).

A token file holds one token per line (``#`` comments allowed): the scheduler
accepts each, so a token is rotated by adding the new one, moving the executors
to it, then removing the old one; an executor uses the first, and reads the file
again at every connection.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import re
import secrets
from pathlib import Path

from pagedserve.envargs import read_flag_file
from pagedserve.wire.keys import ClientKeys

MIN_TOKEN_CHARS = 22  # 128 bits of URL-safe base64
MAX_TOKEN_CHARS = 256
MAX_TOKENS = 16
MAX_TOKEN_FILE_BYTES = 16 * 1024
PROOF_BYTES = 32
_TOKEN = re.compile(rb"^[\x21-\x7e]+$")  # printable ASCII without spaces
_CONTEXT = b"pagedserve/v1 executor enrollment\0"
log = logging.getLogger(__name__)


def new_token() -> str:
    return secrets.token_urlsafe(32)


def read_tokens(path: str | os.PathLike, flag: str = "--enrollment-token-file") -> tuple[bytes, ...]:
    """The tokens in a token file; ValueError naming the flag, the file and the line when unusable
    (the message never repeats a token)."""
    tokens = []
    for number, line in enumerate(read_flag_file(path, flag, MAX_TOKEN_FILE_BYTES).splitlines(), 1):
        line = line.strip()
        if not line or line.startswith(b"#"):
            continue
        if not _TOKEN.match(line) or not MIN_TOKEN_CHARS <= len(line) <= MAX_TOKEN_CHARS:
            raise ValueError(f"{flag}: line {number} of {path}: a token is {MIN_TOKEN_CHARS} to {MAX_TOKEN_CHARS} "
                             f"printable characters without spaces (got {len(line)}); `pagedserve keys token` makes one")
        tokens.append(line)
    if not tokens:
        raise ValueError(f"{flag}: {path} holds no token")
    if len(tokens) > MAX_TOKENS:
        raise ValueError(f"{flag}: {path} holds {len(tokens)} tokens, at most {MAX_TOKENS}")
    return tuple(tokens)


def proof(token: bytes, server_public: bytes, executor_public: bytes, executor_id: str) -> bytes:
    """What an executor holding ``token`` sends in its handshake (keys z85-encoded)."""
    message = _CONTEXT + server_public + executor_public + executor_id.encode()
    return hmac.new(token, message, hashlib.sha256).digest()


def verify(tokens: tuple[bytes, ...], sent: bytes, server_public: bytes, executor_public: bytes,
           executor_id: str) -> bool:
    """Whether ``sent`` is the proof of one of ``tokens`` for this key and id (constant time per token)."""
    ok = False
    for token in tokens:
        ok |= hmac.compare_digest(proof(token, server_public, executor_public, executor_id), sent)
    return ok


class TokenFile:
    """An executor's token file, read again at every connection (a rotated token takes effect at
    the next one); when it cannot be read, the last good token is used and the error logged."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._token = read_tokens(path)[0]  # start-up: an unusable file is a flag error

    def proof(self, keys: ClientKeys, executor_id: str) -> bytes:
        try:
            self._token = read_tokens(self.path)[0]
        except ValueError as exc:
            log.warning("%s; enrolling with the token read before", exc)
        return proof(self._token, keys.server_public, keys.own.public, executor_id)
