"""Executor identities, offline: key files, key lists, enrollment proofs, the scheduler's trust store
(its checks and its reloads), the ROUTER's record of which key sent a message, and `pagedserve keys`."""

from __future__ import annotations

import asyncio
import io
import json
import os
import stat

import pytest
import zmq
import zmq.auth

from pagedserve import wire
from pagedserve.cli import main as cli_main
from pagedserve.wire import enrollment
from pagedserve.wire.key_files import (
    append_to_key_list,
    load_key_pair,
    load_public_key,
    read_key_set,
    write_key_pair,
)
from pagedserve.wire.keys import KeyPair, new_key_pair
from scheduler_svc.engine.executor_auth import ExecutorAuth, LinkSecurity, read_trust


def _handshake(executor_id: str = "ex0", proof: bytes = b"") -> wire.Handshake:
    return wire.Handshake(executor_id, wire.WIRE_VERSION, "f" * 64, "tiny", "LlamaForCausalLM", 512, 16, 64, 0,
                          4096, "float32", "cpu", enrollment_proof=proof)


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    return cli_main(list(argv), out=out, err=err), out.getvalue(), err.getvalue()


# ------------------------------------------------------------------ key files

def test_a_key_pair_is_written_owner_only_in_zeromqs_certificate_format(tmp_path):
    pair = write_key_pair(tmp_path / "k", "ex0")
    secret, public = tmp_path / "k" / "ex0.key_secret", tmp_path / "k" / "ex0.key"
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600 and stat.S_IMODE(public.stat().st_mode) == 0o644
    assert pair.secret not in public.read_bytes()
    assert load_key_pair(secret, "--curve-key-file") == pair and load_public_key(public, "f") == pair.public
    assert zmq.auth.load_certificate(str(secret)) == (pair.public, pair.secret)  # pyzmq/czmq read it too
    with pytest.raises(FileExistsError, match="--keep-existing"):
        write_key_pair(tmp_path / "k", "ex0")
    assert write_key_pair(tmp_path / "k", "ex0", keep_existing=True) == pair  # an init container run again
    with pytest.raises(ValueError, match="--name"):
        write_key_pair(tmp_path / "k", "../escape")


def test_key_lists_read_directories_and_files_with_names(tmp_path):
    a, b = (new_key_pair().public for _ in range(2))
    d = tmp_path / "trusted"
    d.mkdir()
    write_key_pair(tmp_path / "made", "ex0")
    (d / "ex0.key").write_bytes((tmp_path / "made" / "ex0.key").read_bytes())
    (d / "more").write_bytes(b"# operators' list\n\n" + a + b"  pod-a\n" + b + b"\n")
    (d / "..data").mkdir()  # a Kubernetes volume's bookkeeping is not a key file
    (d / "..data" / "junk").write_text("not a key")
    ex0 = load_public_key(tmp_path / "made" / "ex0.key", "f")
    assert read_key_set(d, "--trusted-executor-keys") == {ex0: "ex0", a: "pod-a", b: f"--trusted-executor-keys: {d / 'more'}:4"}
    (tmp_path / "bad").write_bytes(a + b"\nnot-a-key\n")
    with pytest.raises(ValueError, match=r"bad, line 2: expected a 40-character z85 key"):
        read_key_set(tmp_path / "bad", "f")
    assert append_to_key_list(tmp_path / "revoked", a, "pod-a") and not append_to_key_list(tmp_path / "revoked", a, "")
    assert read_key_set(tmp_path / "revoked", "f") == {a: "pod-a"}


# ------------------------------------------------------------------ enrollment proofs

def test_an_enrollment_proof_holds_for_its_token_key_and_id_only():
    server, mine, other = (new_key_pair().public for _ in range(3))
    token, rotated = enrollment.new_token().encode(), enrollment.new_token().encode()
    sent = enrollment.proof(token, server, mine, "ex0")
    assert enrollment.verify((token,), sent, server, mine, "ex0")
    assert enrollment.verify((rotated, token), sent, server, mine, "ex0")  # during a rotation both count
    assert not enrollment.verify((token,), sent, server, other, "ex0")  # replayed from another key
    assert not enrollment.verify((token,), sent, server, mine, "ex1")  # or for another id
    assert not enrollment.verify((rotated,), sent, server, mine, "ex0")  # after the rotation
    assert not enrollment.verify((token,), sent, other, mine, "ex0")  # or to another scheduler


def test_a_token_file_is_checked_and_an_executor_keeps_its_last_good_token(tmp_path):
    path = tmp_path / "token"
    path.write_text("# comment\nshort\n")
    with pytest.raises(ValueError, match="line 2 of .* a token is 22 to 256 printable characters"):
        enrollment.read_tokens(path)
    token = enrollment.new_token()
    path.write_text(token + "\n")
    file = enrollment.TokenFile(path)
    from pagedserve.wire.keys import ClientKeys

    keys = ClientKeys(new_key_pair(), new_key_pair().public)
    expected = enrollment.proof(token.encode(), keys.server_public, keys.own.public, "ex0")
    assert file.proof(keys, "ex0") == expected
    path.write_text("")  # a rotation caught half-way
    assert file.proof(keys, "ex0") == expected
    new = enrollment.new_token()
    path.write_text(new + "\n")
    assert file.proof(keys, "ex0") == enrollment.proof(new.encode(), keys.server_public, keys.own.public, "ex0")


# ------------------------------------------------------------------ the trust store

@pytest.fixture()
def store(tmp_path):
    """A trusted directory with one key, an empty revocation list, no token (yet)."""
    server = new_key_pair()
    trusted, revoked = tmp_path / "trusted", tmp_path / "revoked"
    trusted.mkdir()
    pair = write_key_pair(trusted, "ex0")
    (trusted / "ex0.key_secret").unlink()
    revoked.write_text("")
    link = LinkSecurity(server, trusted, revoked, tmp_path / "token")
    return link, pair


def _auth(link: LinkSecurity, token: str | None = None) -> ExecutorAuth:
    if token is not None:
        link.enrollment_tokens.write_text(token + "\n")
    return ExecutorAuth(link if token is not None else LinkSecurity(link.server, link.trusted_keys, link.revoked_keys))


def test_only_trusted_keys_pass_the_transport_without_enrollment(store):
    link, ex0 = store
    auth = _auth(link)
    stranger = new_key_pair().public
    assert auth.callback("pagedserve-executors", ex0.public) and not auth.callback("d", stranger)
    assert auth.rejection(ex0.public, _handshake()) == (None, False)
    assert auth.rejection(stranger, _handshake()) == ("this executor's key is not trusted", False)
    link.revoked_keys.write_bytes(ex0.public + b" stolen laptop\n")
    auth = _auth(link)
    assert not auth.callback("d", ex0.public)
    assert auth.rejection(ex0.public, _handshake())[0] == "this executor's key is revoked"
    assert not auth.still_admitted(ex0.public, enrolled=False)


def test_an_unknown_key_enrolls_with_a_proof_for_itself_and_never_past_a_revocation(store):
    link, _ = store
    token = enrollment.new_token()
    auth = _auth(link, token)
    newcomer, thief = new_key_pair().public, new_key_pair().public
    proof = enrollment.proof(token.encode(), link.server.public, newcomer, "pod-1")
    assert auth.callback("d", newcomer)  # the transport lets it in: the handshake decides
    assert auth.rejection(newcomer, _handshake("pod-1"))[0].endswith("carries no enrollment proof")
    assert auth.rejection(newcomer, _handshake("pod-1", proof)) == (None, True)
    assert auth.rejection(thief, _handshake("pod-1", proof))[0].startswith("its enrollment proof matches no")
    assert auth.still_admitted(newcomer, enrolled=True)
    link.revoked_keys.write_bytes(newcomer + b"\n")
    auth = _auth(link, token)
    assert not auth.callback("d", newcomer) and auth.rejection(newcomer, _handshake("pod-1", proof))[0].endswith("revoked")
    assert not auth.still_admitted(newcomer, enrolled=True)


def test_the_store_reloads_changed_files_off_the_loop_and_keeps_the_last_good_set(store):
    link, ex0 = store
    auth = _auth(link)
    other = write_key_pair(link.trusted_keys, "ex1")
    (link.trusted_keys / "ex1.key_secret").unlink()
    changes = []

    async def scenario() -> None:
        task = asyncio.create_task(auth.watch(lambda: changes.append(dict(auth.state.trusted)), interval_s=0.02))
        await _until(lambda: len(changes) == 1)  # ex1 added
        assert set(changes[0]) == {ex0.public, other.public}
        (link.trusted_keys / "ex1.key").write_text("garbage\n")  # a broken edit: nothing changes
        await asyncio.sleep(0.2)
        assert len(changes) == 1 and auth.still_admitted(other.public, enrolled=False)
        (link.trusted_keys / "ex1.key").unlink()  # removed: no longer trusted
        await _until(lambda: len(changes) == 2)
        assert not auth.still_admitted(other.public, enrolled=False) and auth.still_admitted(ex0.public, False)
        task.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 10))


async def _until(predicate, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)


def test_reading_the_trust_sources_names_the_flag(store):
    link, _ = store
    (link.trusted_keys / "broken.key").write_text("x\n")
    with pytest.raises(ValueError, match="--trusted-executor-keys: .*broken.key, line 1"):
        read_trust(link)


# ------------------------------------------------------------------ the ROUTER knows which key sent what

def test_the_router_socket_tells_which_curve_key_sent_the_last_message():
    from zmq.auth.thread import ThreadAuthenticator

    from pagedserve.wire.keys import ZAP_DOMAIN, ClientKeys, make_client, make_server
    from pagedserve.wire.router_socket import RouterSocket

    ctx = zmq.Context()
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain=ZAP_DOMAIN.decode(), location=zmq.auth.CURVE_ALLOW_ANY)
    server, a, b = new_key_pair(), new_key_pair(), new_key_pair()

    async def scenario() -> None:
        sock = ctx.socket(zmq.ROUTER)
        make_server(sock, server)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        router = RouterSocket(sock, asyncio.get_running_loop(), peer_keys=True)
        dealers = []
        for name, pair in ((b"a", a), (b"b", b)):
            d = ctx.socket(zmq.DEALER)
            d.routing_id = name
            make_client(d, ClientKeys(pair, server.public))
            d.connect(f"tcp://127.0.0.1:{port}")
            dealers.append(d)
        got = {}
        for d in dealers:
            d.send(b"hello")
            identity, _ = await asyncio.wait_for(router.recv_multipart(), 5)
            got[identity] = router.peer_key(identity)
            with pytest.raises(RuntimeError, match="another peer"):
                router.peer_key(b"a" if identity == b"b" else b"b")
        assert got == {b"a": a.public, b"b": b.public}
        for d in dealers:
            d.close(linger=0)
        router.close()

    try:
        asyncio.run(scenario())
    finally:
        auth.stop()
        ctx.destroy(linger=0)  # (closes what a failed scenario left open)


# ------------------------------------------------------------------ pagedserve keys

def test_pagedserve_keys_makes_pairs_tokens_and_revocations(tmp_path):
    code, out, err = _cli("keys", "executor", "--out", str(tmp_path), "--name", "pod-a")
    assert code == 0, err
    pair = load_key_pair(tmp_path / "pod-a.key_secret", "f")
    assert pair.public.decode() in out and pair.secret.decode() not in out
    assert _cli("keys", "executor", "--out", str(tmp_path), "--name", "pod-a")[0] == 1  # never overwritten
    assert _cli("keys", "show", str(tmp_path / "pod-a.key_secret"))[1].strip() == pair.public.decode()
    code, out, _ = _cli("keys", "revoke", "--list", str(tmp_path / "revoked"), str(tmp_path / "pod-a.key"),
                        "--name", "pod-a")
    assert code == 0 and read_key_set(tmp_path / "revoked", "f") == {pair.public: "pod-a"}
    assert _cli("keys", "revoke", "--list", str(tmp_path / "revoked"), "not-a-key")[0] == 1
    code, out, _ = _cli("keys", "token", "--out", str(tmp_path / "token"))
    assert code == 0 and stat.S_IMODE(os.stat(tmp_path / "token").st_mode) == 0o600
    assert len(enrollment.read_tokens(tmp_path / "token")) == 1


def test_pagedserve_keys_kubernetes_prints_a_scheduler_pair_its_public_half_and_a_token(tmp_path):
    from pagedserve import keytool

    code, out, err = _cli("keys", "kubernetes", "--namespace", "ns")
    assert code == 0, err
    items = {(o["kind"], o["metadata"]["name"]): o for o in json.loads(out)["items"]}
    assert {o["metadata"]["namespace"] for o in items.values()} == {"ns"}
    secret = items["Secret", keytool.SCHEDULER_KEY_SECRET]["stringData"][keytool.SCHEDULER_KEY_FILE]
    public = items["ConfigMap", keytool.SCHEDULER_PUBLIC_CONFIGMAP]["data"][keytool.SCHEDULER_PUBLIC_FILE]
    token = items["Secret", keytool.TOKEN_SECRET]["stringData"][keytool.TOKEN_FILE]
    (tmp_path / "s").write_text(secret)
    (tmp_path / "p").write_text(public)
    (tmp_path / "t").write_text(token)
    pair = load_key_pair(tmp_path / "s", "f")
    assert isinstance(pair, KeyPair) and load_public_key(tmp_path / "p", "f") == pair.public
    assert pair.secret.decode() not in public and len(enrollment.read_tokens(tmp_path / "t")) == 1


def test_a_cluster_secret_admits_the_one_executor_key_derived_from_it():
    from pagedserve.wire.keys import derive_keys

    keys = derive_keys(b"s" * 32)
    auth = ExecutorAuth(LinkSecurity(keys.server, fixed_keys=frozenset({keys.executor_public})))
    assert not auth.link.reloadable and "--cluster-secret-file" in auth.describe()
    assert auth.callback("d", keys.executor_public) and auth.rejection(keys.executor_public, _handshake()) == (None, False)
    assert not auth.callback("d", derive_keys(b"t" * 32).executor_public)
    assert keys.client.server_public == keys.server.public  # what an executor given the same secret dials with
