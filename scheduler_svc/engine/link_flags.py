"""The scheduler's flags for the executor link's keys, and the checked :class:`LinkSecurity` they make.

Either identities (``--curve-secret-key-file``, the scheduler's own key pair,
with ``--trusted-executor-keys`` and/or ``--enrollment-token-file``, and
optionally ``--revoked-executor-keys``) or, on one machine or for development,
``--cluster-secret-file``. Every file is read once here, so a bad one fails
start-up with an error naming its flag; the scheduler's key pair is never read
again, the lists and tokens are re-read when they change
(``scheduler_svc/engine/executor_auth.py``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from pagedserve.wire.key_files import load_key_pair
from pagedserve.wire.keys import load_cluster_keys
from scheduler_svc.engine.executor_auth import (
    REVOKED_FLAG,
    TOKEN_FLAG,
    TRUSTED_FLAG,
    LinkSecurity,
    read_trust,
)

KEY_FLAG, SECRET_FLAG = "--curve-secret-key-file", "--cluster-secret-file"


def add_link_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(KEY_FLAG, type=Path, default=None,
                   help="the scheduler's own CURVE key pair (`pagedserve keys scheduler` writes NAME.key_secret; its "
                        "secret key stays here, executors get NAME.key): the executor link is then authenticated "
                        f"and encrypted; needs {TRUSTED_FLAG} or {TOKEN_FLAG}")
    p.add_argument(TRUSTED_FLAG, type=Path, default=None,
                   help="executor public keys admitted: a directory of NAME.key files (`pagedserve keys executor`), "
                        "or a file of lines 'KEY [name]'; re-read when it changes (a key removed is revoked)")
    p.add_argument(REVOKED_FLAG, type=Path, default=None,
                   help="executor public keys never admitted, even enrolling (a directory or a file, as "
                        f"{TRUSTED_FLAG}); re-read when it changes: a live executor with a revoked key is dropped "
                        "and its requests move")
    p.add_argument(TOKEN_FLAG, type=Path, default=None,
                   help="enrollment tokens, one per line (`pagedserve keys token`): an executor whose key is not "
                        "trusted may join by proving it holds one, for its own key; re-read when it changes")
    p.add_argument(SECRET_FLAG, type=Path, default=None,
                   help="one machine or development only: a secret (>= 16 bytes) the scheduler and every executor "
                        "share, from which both derive the link's keys; every holder can act as the scheduler "
                        f"and no executor can be revoked alone (use {KEY_FLAG} for deployments)")


def link_security(a: argparse.Namespace) -> LinkSecurity | None:
    """The executor link's keys from the parsed flags (None: no CURVE); ValueError naming the flag."""
    identity_flags = {TRUSTED_FLAG: a.trusted_executor_keys, REVOKED_FLAG: a.revoked_executor_keys,
                      TOKEN_FLAG: a.enrollment_token_file}
    given = [flag for flag, value in identity_flags.items() if value is not None]
    if a.cluster_secret_file is not None:
        if a.curve_secret_key_file is not None or given:
            raise ValueError(f"{SECRET_FLAG}: not with {', '.join([KEY_FLAG] * (a.curve_secret_key_file is not None) + given)} "
                             f"(a cluster secret is the keys of both sides)")
        keys = load_cluster_keys(a.cluster_secret_file)
        return LinkSecurity(keys.server, fixed_keys=frozenset({keys.executor_public}))
    if a.curve_secret_key_file is None:
        if given:
            raise ValueError(f"{given[0]}: needs {KEY_FLAG} (the scheduler's own key pair)")
        return None
    if a.trusted_executor_keys is None and a.enrollment_token_file is None:
        raise ValueError(f"{KEY_FLAG}: give {TRUSTED_FLAG} or {TOKEN_FLAG}, or no executor can join")
    for flag in (TRUSTED_FLAG, REVOKED_FLAG):
        path = identity_flags[flag]
        if path is not None and not path.exists():
            raise ValueError(f"{flag}: {path} does not exist (an empty directory or file trusts nothing)")
    link = LinkSecurity(load_key_pair(a.curve_secret_key_file, KEY_FLAG), a.trusted_executor_keys,
                        a.revoked_executor_keys, a.enrollment_token_file)
    read_trust(link)  # (once now: a bad file fails start-up, naming its flag)
    return link
