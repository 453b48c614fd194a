"""``pagedserve keys``: the key files of the executor link (docs/ARCHITECTURE.md, "Security model").

    pagedserve keys scheduler --out DIR      # DIR/scheduler.key_secret (0600, stays on the scheduler) + .key
    pagedserve keys executor --out DIR       # DIR/executor.key_secret (0600) + DIR/executor.key
    pagedserve keys token [--out FILE]       # a new enrollment token
    pagedserve keys show FILE                # the public key in a key file
    pagedserve keys revoke --list FILE KEY   # add a key (or a key file's) to a revocation list
    pagedserve keys kubernetes | kubectl create -f -   # the scheduler's Secret and ConfigMap, the token's Secret

The key logic lives in ``pagedserve/wire/`` (``keys.py``, ``key_files.py``,
``enrollment.py``); this module only turns it into subcommands. Exit status 0,
or 1 with ``error: ...`` on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import TextIO

NAMESPACE = "pagedserve"
# What `keys kubernetes` makes, and k8s/ mounts (tests/test_k8s_manifests.py checks they agree).
SCHEDULER_KEY_SECRET, SCHEDULER_KEY_FILE = "pagedserve-scheduler-key", "scheduler.key_secret"
SCHEDULER_PUBLIC_CONFIGMAP, SCHEDULER_PUBLIC_FILE = "pagedserve-scheduler-public-key", "scheduler.key"
TOKEN_SECRET, TOKEN_FILE = "pagedserve-enrollment-token", "enrollment-token"


def add_parser(sub: argparse._SubParsersAction) -> None:
    keys = sub.add_parser("keys", help="make the executor link's keys (CurveZMQ) and enrollment tokens")
    ksub = keys.add_subparsers(dest="keys_command", required=True)
    for role, what in (("scheduler", "the scheduler's key pair: its secret key never leaves the scheduler"),
                       ("executor", "an executor's own key pair"),
                       ("front", "a front's own key pair (pagedserve-front; the scheduler admits it with "
                                 "--trusted-front-keys)")):
        p = ksub.add_parser(role, help=what)
        p.add_argument("--out", type=Path, required=True, help="directory to write NAME.key_secret and NAME.key in")
        p.add_argument("--name", default=role, help="file name (default %(default)s)")
        p.add_argument("--keep-existing", action="store_true",
                       help="if NAME.key_secret exists, keep it (checked) instead of failing: for a pod's init "
                            "container that may run again")
        p.set_defaults(keys_func=_cmd_pair)
    p = ksub.add_parser("token", help="a new enrollment token")
    p.add_argument("--out", type=Path, default=None, help="write it to this new file (0600) instead of stdout")
    p.set_defaults(keys_func=_cmd_token)
    p = ksub.add_parser("show", help="print the public key in a key file (public or secret)")
    p.add_argument("file", type=Path)
    p.set_defaults(keys_func=_cmd_show)
    p = ksub.add_parser("revoke", help="add an executor key to a revocation list (--revoked-executor-keys)")
    p.add_argument("--list", type=Path, required=True, dest="list_file", help="the list file (created if missing)")
    p.add_argument("key", help="the executor's public key (z85), or a key file holding it")
    p.add_argument("--name", default="", help="a name kept beside the key (e.g. the executor id)")
    p.set_defaults(keys_func=_cmd_revoke)
    p = ksub.add_parser("kubernetes", help="print the Secrets and ConfigMap k8s/ mounts, with new keys and token, "
                                           "for `kubectl create -f -`")
    p.add_argument("--namespace", default=NAMESPACE)
    p.set_defaults(keys_func=_cmd_kubernetes)


def run(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    try:
        args.keys_func(args, out)
    except (ValueError, OSError, RuntimeError) as exc:  # (FileExistsError is an OSError)
        print(f"error: {exc}", file=err)
        return 1
    except ImportError as exc:
        print(f"error: `pagedserve keys` needs pyzmq (pip install 'pagedserve[scheduler]'): {exc}", file=err)
        return 1
    return 0


def _cmd_pair(args: argparse.Namespace, out: TextIO) -> None:
    from pagedserve.wire.key_files import PUBLIC_SUFFIX, SECRET_SUFFIX, write_key_pair

    pair = write_key_pair(args.out, args.name, keep_existing=args.keep_existing)
    print(f"{args.out / (args.name + SECRET_SUFFIX)}: the secret key (keep it where it is)\n"
          f"{args.out / (args.name + PUBLIC_SUFFIX)}: the public key {pair.public.decode()}", file=out)


def _cmd_token(args: argparse.Namespace, out: TextIO) -> None:
    from pagedserve.wire.enrollment import new_token

    token = new_token()
    if args.out is None:
        print(token, file=out)
        return
    fd = os.open(args.out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    print(f"{args.out}: a new enrollment token", file=out)


def _cmd_show(args: argparse.Namespace, out: TextIO) -> None:
    from pagedserve.wire.key_files import load_key_pair, load_public_key

    try:
        key = load_public_key(args.file, str(args.file))
    except ValueError as exc:
        if "holds a secret key" not in str(exc):
            raise
        key = load_key_pair(args.file, str(args.file)).public
    print(key.decode(), file=out)


def _cmd_revoke(args: argparse.Namespace, out: TextIO) -> None:
    from pagedserve.wire.key_files import append_to_key_list, load_public_key
    from pagedserve.wire.keys import check_key

    path = Path(args.key)
    key = load_public_key(path, "key") if path.is_file() else check_key(args.key.encode(), "key")
    added = append_to_key_list(args.list_file, key, args.name)
    print(f"{key.decode()} {'added to' if added else 'was already in'} {args.list_file}", file=out)


def kubernetes_objects(namespace: str) -> dict:
    """A ``List`` of the objects k8s/ expects: the scheduler's key pair (a Secret only the scheduler
    mounts), its public key (a ConfigMap the executors mount) and an enrollment token (a Secret both
    mount). Each executor pod makes its own key pair at start (k8s/base/executor.yaml)."""
    from pagedserve.wire.enrollment import new_token
    from pagedserve.wire.key_files import certificate
    from pagedserve.wire.keys import new_key_pair

    pair = new_key_pair()
    labels = {"app.kubernetes.io/name": "pagedserve", "app.kubernetes.io/part-of": "pagedserve"}

    def obj(kind: str, name: str, data_field: str, data: dict[str, str]) -> dict:
        body = {"apiVersion": "v1", "kind": kind, "metadata": {"name": name, "namespace": namespace, "labels": labels},
                data_field: data}
        return {**body, "type": "Opaque"} if kind == "Secret" else body

    return {"apiVersion": "v1", "kind": "List", "items": [
        obj("Secret", SCHEDULER_KEY_SECRET, "stringData",
            {SCHEDULER_KEY_FILE: certificate("scheduler", pair.public, pair.secret).decode()}),
        obj("ConfigMap", SCHEDULER_PUBLIC_CONFIGMAP, "data",
            {SCHEDULER_PUBLIC_FILE: certificate("scheduler", pair.public).decode()}),
        obj("Secret", TOKEN_SECRET, "stringData", {TOKEN_FILE: new_token() + "\n"}),
    ]}


def _cmd_kubernetes(args: argparse.Namespace, out: TextIO) -> None:
    # JSON is YAML: kubectl reads it. `kubectl create` (not apply: apply would copy the secrets into the
    # last-applied-configuration annotation) refuses to replace existing keys by accident.
    print(json.dumps(kubernetes_objects(args.namespace), indent=2), file=out)
