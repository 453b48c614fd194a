"""CurveZMQ keys of the executor link.

The scheduler's ROUTER is the CURVE server; executors are CURVE clients, each
knowing the server's public key. Two ways to key the link:

* **Identities** (any deployment): the scheduler has its own key pair, and its
  secret key never leaves it; each executor has its own key pair and the
  scheduler's public key. The scheduler's ZAP handler admits the executor keys
  it trusts (``scheduler_svc/engine/executor_auth.py``), so one executor can be revoked
  without touching the others. ``pagedserve keys`` makes the key files
  (``pagedserve/wire/key_files.py``).
* **A cluster secret** (one machine, or development): both services derive the
  same two key pairs from one shared secret with HMAC-SHA256, one per role, so
  neither key is the secret itself. Every holder of the secret can therefore act
  as the scheduler, and all executors share one identity.

Keys are z85-encoded (40 characters), the form pyzmq's socket options take. A
peer whose key the scheduler does not admit cannot complete the transport
handshake: it never gets a frame through, and nothing it sends reaches Python.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
from dataclasses import dataclass, field

import zmq
from zmq.utils import z85

from pagedserve.envargs import read_flag_file

MIN_SECRET_BYTES = 16  # 128 bits
MAX_SECRET_BYTES = 4096
KEY_CHARS = 40  # a Curve25519 key (32 bytes) in z85
ZAP_DOMAIN = b"pagedserve-executors"


@dataclass(frozen=True, slots=True)
class KeyPair:
    """One party's CURVE key pair. The secret key stays out of ``repr``: configurations holding
    it may be logged."""

    public: bytes
    secret: bytes = field(repr=False)


@dataclass(frozen=True, slots=True)
class ClientKeys:
    """What an executor needs to dial in: its own key pair and the scheduler's public key."""

    own: KeyPair
    server_public: bytes


@dataclass(frozen=True, slots=True)
class ClusterKeys:
    """The two key pairs derived from a cluster secret (development and one-machine setups)."""

    server_public: bytes
    server_secret: bytes = field(repr=False)
    executor_public: bytes
    executor_secret: bytes = field(repr=False)

    @property
    def server(self) -> KeyPair:
        return KeyPair(self.server_public, self.server_secret)

    @property
    def client(self) -> ClientKeys:
        return ClientKeys(KeyPair(self.executor_public, self.executor_secret), self.server_public)


def require_curve() -> None:
    if not zmq.has("curve"):
        raise RuntimeError("this libzmq was built without CURVE support; the executor link cannot be encrypted")


def new_key_pair() -> KeyPair:
    """A fresh key pair from libzmq's generator (the operating system's randomness)."""
    require_curve()
    public, secret = zmq.curve_keypair()
    return KeyPair(public, secret)


def check_key(key: bytes, what: str) -> bytes:
    """``key`` if it is a z85-encoded Curve25519 key; ValueError naming ``what`` otherwise."""
    if len(key) != KEY_CHARS:
        raise ValueError(f"{what}: a CURVE key is {KEY_CHARS} z85 characters, got {len(key)}")
    try:
        z85.decode(key)
    except (ValueError, KeyError, struct.error):  # (KeyError: a character outside z85; struct.error: overflow)
        raise ValueError(f"{what}: not a z85-encoded CURVE key") from None
    return key


def pair_from(public: bytes, secret: bytes, what: str) -> KeyPair:
    """A checked key pair: both keys well formed, and the public key the secret key's own."""
    require_curve()
    check_key(public, what)
    check_key(secret, what)
    if not hmac.compare_digest(zmq.curve_public(secret), public):
        raise ValueError(f"{what}: the public key is not the secret key's (a file from two different pairs?)")
    return KeyPair(public, secret)


# ------------------------------------------------------------------ the cluster secret

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
    require_curve()
    server = _derived_pair(secret, b"pagedserve/v1 executor link: scheduler")
    executor = _derived_pair(secret, b"pagedserve/v1 executor link: executor")
    return ClusterKeys(server.public, server.secret, executor.public, executor.secret)


def _derived_pair(secret: bytes, role: bytes) -> KeyPair:
    # Any 32 bytes are a Curve25519 secret key (it is clamped when used).
    secret_key = z85.encode(hmac.new(secret, role, hashlib.sha256).digest())
    return KeyPair(zmq.curve_public(secret_key), secret_key)


# ------------------------------------------------------------------ sockets

def make_server(sock: zmq.Socket, server: KeyPair, zap_domain: bytes = ZAP_DOMAIN) -> None:
    """The scheduler's ROUTER: CURVE server with its own key pair, every client checked by the ZAP
    handler of ``zap_domain`` (the executors', unless given; set before bind)."""
    sock.curve_secretkey = server.secret
    sock.curve_publickey = server.public
    sock.curve_server = True
    sock.zap_domain = zap_domain


def make_client(sock: zmq.Socket, keys: ClientKeys) -> None:
    """An executor's DEALER: CURVE client with its own key pair that knows the scheduler's public
    key (set before connect)."""
    sock.curve_secretkey = keys.own.secret
    sock.curve_publickey = keys.own.public
    sock.curve_serverkey = keys.server_public
