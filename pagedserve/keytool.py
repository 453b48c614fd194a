"""``pagedserve keys``: the key files of the executor link (docs/ARCHITECTURE.md, "Security model").

    pagedserve keys scheduler --out DIR      # DIR/scheduler.key_secret (0600, stays on the scheduler) + .key
    pagedserve keys executor --out DIR       # DIR/executor.key_secret (0600) + DIR/executor.key
    pagedserve keys token [--out FILE]       # a new enrollment token
    pagedserve keys show FILE                # the public key in a key file
    pagedserve keys revoke --list FILE KEY   # add a key (or a key file's) to a revocation list
    pagedserve keys kubernetes | kubectl create -f -   # the Secrets and ConfigMaps k8s/ mounts (all keys, the token)
    pagedserve keys kubernetes --fronts-only | ...      # only the fronts' (k8s/components/fronts)

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
# What `keys kubernetes` makes, and k8s/ mounts (tests/deploy/test_k8s_manifests.py checks they agree).
SCHEDULER_KEY_SECRET, SCHEDULER_KEY_FILE = "pagedserve-scheduler-key", "scheduler.key_secret"
SCHEDULER_PUBLIC_CONFIGMAP, SCHEDULER_PUBLIC_FILE = "pagedserve-scheduler-public-key", "scheduler.key"
TOKEN_SECRET, TOKEN_FILE = "pagedserve-enrollment-token", "enrollment-token"
# The fronts of their own Deployment share one key pair: they hold no scheduling state, so one
# identity for all of them loses nothing (executors, which serve requests, each have their own).
FRONT_KEY_SECRET, FRONT_KEY_FILE = "pagedserve-front-key", "front.key_secret"
TRUSTED_FRONTS_CONFIGMAP, FRONT_PUBLIC_FILE = "pagedserve-trusted-front-keys", "front.key"


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
    p = ksub.add_parser("kubernetes", help="print the Secrets and ConfigMaps k8s/ mounts, with new keys and token, "
                                           "for `kubectl create -f -`")
    p.add_argument("--namespace", default=NAMESPACE)
    p.add_argument("--fronts-only", action="store_true",
                   help="only the fronts' key pair (a Secret) and its public key (a ConfigMap the scheduler "
                        "trusts), for a cluster whose executor-link keys exist (k8s/components/fronts)")
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


def kubernetes_objects(namespace: str, fronts_only: bool = False) -> dict:
    """A ``List`` of the objects k8s/ expects: the scheduler's key pair (a Secret only the scheduler
    mounts), its public key (a ConfigMap executors and fronts mount), an enrollment token (a Secret the
    scheduler and executors mount), and the fronts' key pair (a Secret the front Deployment mounts)
    with its public key (a ConfigMap the scheduler trusts). Each executor pod makes its own key pair at
    start (k8s/base/executor.yaml). ``fronts_only``: the last two alone."""
    from pagedserve.wire.enrollment import new_token

    def obj(kind: str, name: str, data_field: str, data: dict[str, str]) -> dict:
        labels = {"app.kubernetes.io/name": "pagedserve", "app.kubernetes.io/part-of": "pagedserve"}
        body = {"apiVersion": "v1", "kind": kind, "metadata": {"name": name, "namespace": namespace, "labels": labels},
                data_field: data}
        return {**body, "type": "Opaque"} if kind == "Secret" else body

    items = []
    if not fronts_only:
        secret, public = _pair_files("scheduler")
        items += [obj("Secret", SCHEDULER_KEY_SECRET, "stringData", {SCHEDULER_KEY_FILE: secret}),
                  obj("ConfigMap", SCHEDULER_PUBLIC_CONFIGMAP, "data", {SCHEDULER_PUBLIC_FILE: public}),
                  obj("Secret", TOKEN_SECRET, "stringData", {TOKEN_FILE: new_token() + "\n"})]
    secret, public = _pair_files("front")
    items += [obj("Secret", FRONT_KEY_SECRET, "stringData", {FRONT_KEY_FILE: secret}),
              obj("ConfigMap", TRUSTED_FRONTS_CONFIGMAP, "data", {FRONT_PUBLIC_FILE: public})]
    return {"apiVersion": "v1", "kind": "List", "items": items}


def _pair_files(name: str) -> tuple[str, str]:
    """A new key pair as the texts of its two certificate files (secret, public)."""
    from pagedserve.wire.key_files import certificate
    from pagedserve.wire.keys import new_key_pair

    pair = new_key_pair()
    return certificate(name, pair.public, pair.secret).decode(), certificate(name, pair.public).decode()


def _cmd_kubernetes(args: argparse.Namespace, out: TextIO) -> None:
    # JSON is YAML: kubectl reads it. `kubectl create` (not apply: apply would copy the secrets into the
    # last-applied-configuration annotation) refuses to replace existing keys by accident.
    print(json.dumps(kubernetes_objects(args.namespace, args.fronts_only), indent=2), file=out)
