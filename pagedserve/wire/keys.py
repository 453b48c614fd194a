"""CurveZMQ keys of the executor link, derived from one shared cluster secret.

Both services read the same secret file (``--cluster-secret-file``) and derive
the same two Curve25519 key pairs from it with HMAC-SHA256 (one per role, so
neither key is the secret itself): the scheduler's ROUTER is the CURVE server,
executors are CURVE clients, and the scheduler's ZAP handler admits exactly the
executor public key. A peer without the secret cannot complete the transport
handshake: it never gets a frame through, and nothing it sends reaches Python.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

from pagedserve.envargs import read_flag_file

MIN_SECRET_BYTES = 16  # 128 bits
MAX_SECRET_BYTES = 4096


@dataclass(frozen=True, slots=True)
class ClusterKeys:
    """z85-encoded CURVE keys (the form pyzmq's socket options take). The secret keys stay out of
    ``repr``: configurations holding them may be logged."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    executor_public: bytes
    executor_secret: bytes = field(repr=False)


def read_cluster_secret(path: str | os.PathLike, flag: str = "--cluster-secret-file") -> bytes:
    """The secret's bytes (surrounding whitespace stripped); ValueError naming the flag if unusable."""
    secret = read_flag_file(path, flag, MAX_SECRET_BYTES).strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"{flag}: the secret in {path} must be at least {MIN_SECRET_BYTES} bytes "
                         f"(got {len(secret)}); e.g. head -c 32 /dev/urandom | base64 > {path}")
    return secret


def load_cluster_keys(path: str | os.PathLike, flag: str = "--cluster-secret-file") -> ClusterKeys:
    """The keys of the secret in ``path``, read once at start-up: ValueError naming the flag if the
    file is unusable, RuntimeError if this libzmq cannot encrypt."""
    return derive_keys(read_cluster_secret(path, flag))


def derive_keys(secret: bytes) -> ClusterKeys:
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support; the executor link cannot be encrypted")
    server = _key_pair(secret, b"pagedserve/v1 executor link: scheduler")
    executor = _key_pair(secret, b"pagedserve/v1 executor link: executor")
    return ClusterKeys(server[0], server[1], executor[0], executor[1])


def _key_pair(secret: bytes, role: bytes) -> tuple[bytes, bytes]:
    # Any 32 bytes are a Curve25519 secret key (it is clamped when used).
    secret_key = z85.encode(hmac.new(secret, role, hashlib.sha256).digest())
    return zmq.curve_public(secret_key), secret_key


def make_server(sock: zmq.Socket, keys: ClusterKeys) -> None:
    """The scheduler's ROUTER: CURVE server with the scheduler key pair (set before bind)."""
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN


def make_client(sock: zmq.Socket, keys: ClusterKeys) -> None:
    """An executor's DEALER: CURVE client that knows the scheduler's public key (set before connect)."""
    sock.curve_secretkey = keys.executor_secret
    sock.curve_publickey = keys.executor_public
    sock.curve_serverkey = keys.server_public


ZAP_DOMAIN = b"pagedserve-executors"
