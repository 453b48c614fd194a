"""Which executors may use the executor link: trusted keys, enrollment, revocation.

An executor's identity is its CURVE public key. The scheduler admits a key when
it is not revoked and either

* it is **trusted**: listed in ``--trusted-executor-keys`` (a key list: a file,
  or a directory of public key files, ``pagedserve/wire/key_files.py``), or the
  key derived from ``--cluster-secret-file``; or
* it **enrolls**: its handshake carries an enrollment token's proof for this very
  key (``pagedserve/wire/enrollment.py``), against a token of
  ``--enrollment-token-file``. Enrolled keys are held for as long as their
  connection lives; an executor proves itself again at every connection, so
  nothing is written on the scheduler and its restarts lose nothing.

``--revoked-executor-keys`` (a key list too) wins over both. The lists and the
token file are polled off the event loop and re-read when they change
(Kubernetes updates mounted Secrets and ConfigMaps in place); a reading that
fails keeps the last good one. After each change the hub drops every live
executor whose key is no longer admitted.

Checked twice: at the transport (the ZAP handler, :meth:`ExecutorAuth.callback`:
without enrollment, a peer whose key is not trusted never gets a frame through),
and at the handshake (:meth:`ExecutorAuth.rejection`, with the key ZAP
authenticated), which alone can check an enrollment proof.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve import wire
from pagedserve.ratelog import RateLimitedLog
from pagedserve.wire import enrollment
from pagedserve.wire.key_files import key_list_signature, read_key_set
from pagedserve.wire.keys import KeyPair

log = logging.getLogger(__name__)
denied_warning = RateLimitedLog(log)
reload_warning = RateLimitedLog(log, interval_s=60.0)
RELOAD_INTERVAL_S = 1.0
TRUSTED_FLAG, REVOKED_FLAG, TOKEN_FLAG = "--trusted-executor-keys", "--revoked-executor-keys", "--enrollment-token-file"


@dataclass(frozen=True, slots=True)
class LinkSecurity:
    """The scheduler's side of the executor link, as configured: its own key pair, and where the keys
    it admits come from."""

    server: KeyPair
    trusted_keys: Path | None = None  # key list of trusted executor keys (re-read on change)
    revoked_keys: Path | None = None  # key list of keys never admitted (re-read on change)
    enrollment_tokens: Path | None = None  # token file (re-read on change); None: no enrollment
    fixed_keys: frozenset[bytes] = frozenset()  # always trusted: the key derived from a cluster secret

    @property
    def reloadable(self) -> bool:
        """Whether any source is a file read again when it changes."""
        return any(p is not None for p in (self.trusted_keys, self.revoked_keys, self.enrollment_tokens))


@dataclass(frozen=True, slots=True)
class TrustState:
    """One reading of the key lists and the token file."""

    trusted: dict[bytes, str] = field(default_factory=dict)  # z85 key -> name (file or list entry)
    revoked: dict[bytes, str] = field(default_factory=dict)
    tokens: tuple[bytes, ...] = ()


def read_trust(link: LinkSecurity) -> TrustState:
    """Read every source once (blocking); ValueError naming the flag of an unusable one."""
    trusted = read_key_set(link.trusted_keys, TRUSTED_FLAG) if link.trusted_keys is not None else {}
    revoked = read_key_set(link.revoked_keys, REVOKED_FLAG) if link.revoked_keys is not None else {}
    tokens = enrollment.read_tokens(link.enrollment_tokens, TOKEN_FLAG) if link.enrollment_tokens is not None else ()
    return TrustState(trusted, revoked, tokens)


class ExecutorAuth:
    """The live trust store of one scheduler: the ZAP callback, the handshake check, the reloads."""

    def __init__(self, link: LinkSecurity) -> None:
        self.link = link
        self._seen = self._signature()  # (before the read: a change made meanwhile is read again)
        self.state = read_trust(link)

    def describe(self) -> str:
        """One line for the log: where the keys come from and how many there are."""
        if self.link.fixed_keys:
            return ("keyed by --cluster-secret-file: every executor holding it can act as the scheduler and none "
                    "can be revoked alone (deployments use --curve-secret-key-file)")
        s = self.state
        return (f"{len(s.trusted)} trusted executor keys, {len(s.revoked)} revoked, enrollment "
                f"{f'with {len(s.tokens)} tokens' if s.tokens else 'off'}")

    # -------------------------------------------------------------- checks

    def callback(self, domain: str, client_key: bytes) -> bool:
        """ZAP (pyzmq's ``configure_curve_callback``): may a connection with this key complete the
        transport handshake? Runs on the event loop: a few set lookups."""
        state = self.state
        if client_key in state.revoked:
            denied_warning("refused a connection with revoked executor key %s (%s)", client_key.decode(),
                           state.revoked[client_key])
            return False
        if self._trusted(client_key) or state.tokens:
            return True
        denied_warning("refused a connection with executor key %s: not among %s", client_key.decode(),
                       TRUSTED_FLAG if self.link.trusted_keys is not None else "the trusted keys")
        return False

    def rejection(self, key: bytes, hs: wire.Handshake) -> tuple[str | None, bool]:
        """Whether the executor whose connection authenticated with ``key`` may register as ``hs``
        says: (why not, or None; whether it got in by enrolling)."""
        state = self.state
        if key in state.revoked:
            return "this executor's key is revoked", False
        if self._trusted(key):
            return None, False
        if not state.tokens:
            return "this executor's key is not trusted", False
        if not hs.enrollment_proof:
            return "this executor's key is not trusted, and its handshake carries no enrollment proof", False
        if not enrollment.verify(state.tokens, hs.enrollment_proof, self.link.server.public, key, hs.executor_id):
            return "its enrollment proof matches no enrollment token (for this key and executor id)", False
        return None, True

    def still_admitted(self, key: bytes, enrolled: bool) -> bool:
        """Whether a live executor that registered with ``key`` may stay (checked after each reload): an
        enrolled key stays until revoked, a trusted one until revoked or no longer listed."""
        return key not in self.state.revoked and (enrolled or self._trusted(key))

    def _trusted(self, key: bytes) -> bool:
        return key in self.link.fixed_keys or key in self.state.trusted

    # -------------------------------------------------------------- reloads

    def _signature(self) -> tuple:
        return tuple(key_list_signature(p) if p is not None else None
                     for p in (self.link.trusted_keys, self.link.revoked_keys, self.link.enrollment_tokens))

    async def watch(self, on_change: Callable[[], None], interval_s: float = RELOAD_INTERVAL_S) -> None:
        """Poll the sources (in a worker thread) and re-read them when they change; then call
        ``on_change`` (the hub drops executors no longer admitted). Runs until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                now = await asyncio.to_thread(self._signature)
                if now == self._seen:
                    continue
                state = await asyncio.to_thread(read_trust, self.link)
            except (ValueError, OSError) as exc:
                reload_warning("executor keys changed but cannot be read; keeping the last good set: %s", exc)
                continue
            self._seen = now
            self._log_changes(self.state, state)
            self.state = state
            on_change()

    @staticmethod
    def _log_changes(old: TrustState, new: TrustState) -> None:
        for key in new.trusted.keys() - old.trusted.keys():
            log.info("executor key %s (%s) is trusted", key.decode(), new.trusted[key])
        for key in old.trusted.keys() - new.trusted.keys():
            log.warning("executor key %s (%s) is no longer trusted", key.decode(), old.trusted[key])
        for key in new.revoked.keys() - old.revoked.keys():
            log.warning("executor key %s (%s) is revoked", key.decode(), new.revoked[key])
        for key in old.revoked.keys() - new.revoked.keys():
            log.info("executor key %s (%s) is no longer revoked", key.decode(), old.revoked[key])
        if new.tokens != old.tokens:
            log.info("enrollment tokens changed: %d accepted", len(new.tokens))
