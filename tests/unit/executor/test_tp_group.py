"""The pieces of a tensor-parallel group, each alone: flags, sharding rules, per-rank parameter
counts, start-up agreement, the plan channel, the watchdog."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
import torch

from executor_svc.config import parse_config
from executor_svc.model import load_model, load_model_config
from executor_svc.parallel.channel import PLAN, STOP, TICK, PlanChannel
from executor_svc.parallel.group import GroupFailure, TPGroup, make_store
from executor_svc.parallel.serve import serve_follower
from executor_svc.parallel.shard import TPShard
from executor_svc.parallel.watchdog import Watchdog
from pagedserve import wire
from testing.tp_harness import connect_threads

BASE = ["--model", "m", "--scheduler", "tcp://h:5556"]
RANKS = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "10.0.0.7", "MASTER_PORT": "29500"}


# ------------------------------------------------------------------ flags

def test_tensor_parallel_size_flag_env_and_rank_variables():
    assert parse_config(BASE, {}).tensor_parallel_size == 1
    cfg = parse_config(BASE, {"PAGEDSERVE_TENSOR_PARALLEL_SIZE": "2"})
    assert cfg.tensor_parallel_size == 2 and cfg.rank_env is None  # no RANK: this process leads
    cfg = parse_config([*BASE, "--tensor-parallel-size", "2"], {**RANKS, "LOCAL_RANK": "0"})
    env = cfg.rank_env
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (1, 2, 0, "10.0.0.7", 29500)
    assert parse_config(BASE, RANKS).rank_env is None  # one rank: torch.distributed's variables are ignored


def test_prepare_ahead_defaults_to_the_device_and_can_be_set_either_way():
    assert parse_config(BASE, {}).prepare_ahead is None  # None: on with CUDA (executor_svc/runner.py)
    assert parse_config([*BASE, "--prepare-ahead"], {}).prepare_ahead is True
    assert parse_config(BASE, {"PAGEDSERVE_PREPARE_AHEAD": "0"}).prepare_ahead is False


@pytest.mark.parametrize("argv,env,message", [
    (["--tensor-parallel-size", "0"], {}, "--tensor-parallel-size: must be >= 1 and <= 1024, got 0"),
    (["--tensor-parallel-size", "4"], RANKS, "--tensor-parallel-size is 4 but WORLD_SIZE is 2"),
    (["--tensor-parallel-size", "2"], {**RANKS, "RANK": "2"}, "RANK: must lie in [0, WORLD_SIZE=2), got 2"),
    (["--tensor-parallel-size", "2"], {**RANKS, "MASTER_ADDR": ""}, "MASTER_ADDR: required with RANK set"),
    (["--tensor-parallel-size", "2"], {**RANKS, "MASTER_PORT": "x"}, "MASTER_PORT: expected an integer, got 'x'"),
    (["--tensor-parallel-size", "2", "--prepare-ahead"], {}, "--prepare-ahead: a tensor-parallel executor runs"),
])
def test_bad_group_settings_name_the_variable_and_the_value(capsys, argv, env, message):
    with pytest.raises(SystemExit):
        parse_config([*BASE, *argv], env)
    assert message in capsys.readouterr().err


# ------------------------------------------------------------------ sharding rules

def test_a_model_that_cannot_split_is_refused_naming_the_flag(tiny_checkpoint):
    cfg = load_model_config(tiny_checkpoint("llama", "tp"))  # 8 q heads, 4 KV heads, 256 MLP columns
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 3: the model's 8 attention heads"):
        TPShard(0, 3).check(cfg)
    six_kv = dataclasses.replace(cfg, num_heads=12, num_kv_heads=6)
    with pytest.raises(ValueError, match=r"--tensor-parallel-size 4: the model's 6 KV heads .*4 must divide 6"):
        TPShard(0, 4).check(six_kv)
    with pytest.raises(ValueError, match="--tensor-parallel-size 2: the model's intermediate_size 255"):
        TPShard(0, 2).check(dataclasses.replace(cfg, intermediate_size=255))
    TPShard(0, 8).check(dataclasses.replace(cfg, num_kv_heads=2))  # 2 KV heads over 8 ranks: replicated 4x


@pytest.mark.parametrize("kv,size,expect", [
    (4, 2, [(0, 2), (2, 2)]), (4, 4, [(0, 1), (1, 1), (2, 1), (3, 1)]),
    (1, 4, [(0, 1)] * 4), (2, 4, [(0, 1), (0, 1), (1, 1), (1, 1)]),
])
def test_kv_heads_follow_the_q_heads_they_serve(tiny_checkpoint, kv, size, expect):
    cfg = load_model_config(tiny_checkpoint("llama", "tp", num_key_value_heads=kv))
    group = cfg.num_heads // cfg.num_kv_heads  # GQA: q head h reads KV head h // group
    for rank in range(size):
        shard = TPShard(rank, size)
        first_q, nq = shard.q_heads(cfg)
        assert shard.kv_heads(cfg) == expect[rank]
        kv0, nkv = shard.kv_heads(cfg)
        assert {h // group for h in range(first_q, first_q + nq)} <= set(range(kv0, kv0 + nkv))


@pytest.mark.parametrize("size", [1, 2, 4])
def test_per_rank_parameter_counts(tiny_checkpoint, size):
    """Each rank holds 1/N of every layer's weights (norms and the replicated o_proj bias aside),
    the embedding everywhere, the LM head on rank 0 only; the shards put together are the model."""
    path = tiny_checkpoint("llama", "tp")
    full = dict(load_model(path).named_parameters())
    shards = [dict(load_model(path, shard=TPShard(r, size)).named_parameters()) for r in range(size)]
    sharded = [n for n in full if n.startswith("layers.") and not n.endswith("norm.weight")]
    for r, params in enumerate(shards):
        for n in sharded:
            assert params[n].numel() * size == full[n].numel(), n
        layer_total = sum(p.numel() for n, p in params.items() if n.startswith("layers."))
        norms = sum(p.numel() for n, p in full.items() if n.endswith("layernorm.weight"))
        assert layer_total == (sum(full[n].numel() for n in sharded) // size) + norms
        assert params["embed_tokens.weight"].shape == full["embed_tokens.weight"].shape
        assert ("lm_head.weight" in params) == (r == 0)
    cfg = load_model_config(path)
    hd, q, kv = cfg.head_dim, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    qkv = full["layers.1.self_attn.qkv_proj.weight"]
    local_q, local_kv = q // size, kv // size
    rebuilt_q = torch.cat([s["layers.1.self_attn.qkv_proj.weight"][:local_q] for s in shards])
    rebuilt_v = torch.cat([s["layers.1.self_attn.qkv_proj.weight"][local_q + local_kv:] for s in shards])
    assert torch.equal(rebuilt_q, qkv[:q]) and torch.equal(rebuilt_v, qkv[q + kv:])
    assert torch.equal(torch.cat([s["layers.0.mlp.down_proj.weight"] for s in shards], dim=1),
                       full["layers.0.mlp.down_proj.weight"])
    assert torch.equal(torch.cat([s["layers.0.self_attn.o_proj.weight"] for s in shards], dim=1),
                       full["layers.0.self_attn.o_proj.weight"])
    assert hd * cfg.num_heads == q


# ------------------------------------------------------------------ start-up agreement

def _on_ranks(groups, fn):
    """fn(group) on every rank concurrently; each rank's result or exception."""
    out: list = [None] * len(groups)

    def run(g):
        try:
            out[g.rank] = fn(g)
        except Exception as exc:  # noqa: BLE001
            out[g.rank] = exc

    threads = [threading.Thread(target=run, args=(g,)) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_ranks_agree_or_every_rank_refuses_naming_the_difference():
    groups = connect_threads(3)
    ident = {"model fingerprint": "abc", "--block-size": "16"}
    assert _on_ranks(groups, lambda g: g.agree(ident)) == [None] * 3
    out = _on_ranks(groups, lambda g: g.agree({**ident, "--block-size": "32" if g.rank == 2 else "16"}))
    for exc in out:
        assert isinstance(exc, ValueError)
        assert "rank 2 has --block-size '32' but rank 0 has '16'" in str(exc)
    assert _on_ranks(groups, lambda g: g.min_over_ranks("blocks", (100 - g.rank, 7 + g.rank))) == [(98, 7)] * 3


# ------------------------------------------------------------------ the plan channel

def test_plans_reach_the_followers_as_wire_bytes_and_tokens_come_after():
    leader, follower = (PlanChannel(g) for g in connect_threads(2))
    plan = wire.BatchPlan(7, [3], [2], new_seqs=[wire.NewSeq(3, wire.pack_ids([1, 2, 3]), 3, [0], 1, wire.SamplingParams())])
    got: list = []

    def follow():
        while True:
            kind, payload = follower.recv()
            got.append((kind, wire.decode(payload) if kind == PLAN else payload))
            if kind == PLAN:
                got.append(follower.recv_tokens(2))
            if kind == STOP:
                return

    t = threading.Thread(target=follow)
    t.start()
    leader.send(TICK)
    leader.send(PLAN, wire.encode(plan))
    leader.send_tokens(0, [11, 12], 2)
    leader.send(STOP)
    t.join(60)
    assert not t.is_alive() and got == [(TICK, b""), (PLAN, plan), [11, 12], (STOP, b"")]


def test_a_corrupt_header_is_a_group_failure():
    leader, follower = connect_threads(2)
    failure: list = []
    t = threading.Thread(target=lambda: failure.append(pytest.raises(GroupFailure, PlanChannel(follower).recv)))
    t.start()
    leader.broadcast(torch.tensor([99, 5], dtype=torch.int64))
    t.join(60)
    assert not t.is_alive() and "corrupt control header [99, 5]" in str(failure[0].value)


# ------------------------------------------------------------------ the watchdog

def _watched(world: int, silent_s: float = 5.0):
    fatal: list[str] = []
    groups = connect_threads(world, on_fatal=fatal.append)
    port = groups[0].store.port
    dogs = [Watchdog(g, "127.0.0.1", port, interval_s=0.05, silent_s=silent_s) for g in groups]
    return groups, dogs, fatal


def test_watchdog_sees_a_started_rank_die():
    groups, dogs, fatal = _watched(2)
    groups[0].children = {1: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(0.3)"])}
    dogs[0].start()
    deadline = time.monotonic() + 10
    while not fatal and time.monotonic() < deadline:
        time.sleep(0.05)
    dogs[0].stop()
    assert fatal and "rank 1 (pid" in fatal[0] and "exited with status 0" in fatal[0]


def test_watchdog_sees_a_silent_rank_and_relays_drains():
    groups, dogs, fatal = _watched(2, silent_s=0.5)
    drained = threading.Event()
    dogs[0].on_drain = drained.set
    for d in dogs:
        d.start()
    dogs[1].request_drain()  # a follower's SIGTERM reaches the leader
    assert drained.wait(30)
    assert not fatal
    dogs[1].stop()  # rank 1 stops beating: to rank 0 it is dead after 0.5 s
    # (0.5 s of rank 0's own turns: a turn late by more than half of that restarts the count, as a
    # starved watchdog must not call its peers dead; a busy machine makes late turns common)
    deadline = time.monotonic() + 30
    while not fatal and time.monotonic() < deadline:
        time.sleep(0.05)
    dogs[0].stop()
    assert fatal and "rank 1 has been silent" in fatal[0]


def test_the_memory_benchmark_reports_halves_per_rank(tiny_checkpoint):
    from testing.tensor_parallel import memory_rows

    rows = {(r["tp"], r["rank"]): r for r in memory_rows(tiny_checkpoint("llama", "tp"), [1, 2], 1 << 20)}
    norms = 2 * 2 * 128 * 4  # two layers' two norms, float32: replicated on every rank
    for rank in (0, 1):
        r = rows[(2, rank)]
        assert r["layer_weight_bytes"] - norms == (rows[(1, 0)]["layer_weight_bytes"] - norms) // 2
        assert r["kv_bytes_per_block"] * 2 == rows[(1, 0)]["kv_bytes_per_block"]
        assert r["kv_blocks"] == 2 * rows[(1, 0)]["kv_blocks"]  # the same bytes hold twice the blocks
    assert rows[(2, 0)]["other_weight_bytes"] > rows[(2, 1)]["other_weight_bytes"]  # the LM head: rank 0 only



def test_a_single_node_group_store_listens_on_loopback_only():
    """The store is unauthenticated: reachable from another host, anyone could drain the group."""
    store = make_store("127.0.0.1", 0, 2, serve=True, timeout_s=5)
    listening = []
    with open("/proc/net/tcp") as f:
        for line in f.readlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            if state == "0A" and int(local.split(":")[1], 16) == store.port:  # 0A: LISTEN
                listening.append(local.split(":")[0])
    assert listening == ["0100007F"]  # 127.0.0.1, not 0.0.0.0
    store.set("k", "v")
    assert make_store("127.0.0.1", store.port, 2, serve=False, timeout_s=5).get("k") == b"v"


def test_a_rank_that_never_joins_is_named_when_start_up_times_out():
    store = make_store("127.0.0.1", 0, 3, serve=True, timeout_s=5)
    group = TPGroup(0, 3, store, torch.device("cpu"), loopback=True)
    with pytest.raises(ValueError, match=r"rank\(s\) 1, 2 did not reach start-up step 'identity' within 1s"):
        group.exchange("identity", "{}", timeout_s=1)


def test_a_started_rank_that_dies_ends_the_start_up_wait_at_once():
    store = make_store("127.0.0.1", 0, 2, serve=True, timeout_s=5)
    group = TPGroup(0, 2, store, torch.device("cpu"), loopback=True)
    group.children = {1: subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])}
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"rank\(s\) 1 exited during start-up \(status 1\)"):
        group.exchange("identity", "{}", timeout_s=60)
    assert time.monotonic() - start < 10


def test_a_follower_waiting_at_start_up_notices_rank_0_is_gone():
    code = ("import time, datetime, torch.distributed as d; "
            "s = d.TCPStore('127.0.0.1', 0, 2, is_master=True, wait_for_workers=False); print(s.port, flush=True); "
            "time.sleep(1.5)")
    rank0 = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    port = int(rank0.stdout.readline())
    group = TPGroup(1, 2, make_store("127.0.0.1", port, 2, serve=False, timeout_s=5), torch.device("cpu"),
                    loopback=True)
    start = time.monotonic()
    with pytest.raises(ValueError, match="lost rank 0's store"):
        group.exchange("identity", "{}", timeout_s=60)
    assert time.monotonic() - start < 10
    rank0.wait()


def test_rank_0_keeps_its_store_up_until_the_followers_stopped_watching_it():
    """Multi-node, a follower is not rank 0's child: rank 0 must not exit (taking the store down)
    while a follower's watchdog still polls it, or that follower calls a normal stop a failure."""
    groups, dogs, fatal = _watched(3)
    for g, d in zip(groups, dogs, strict=True):
        g.watchdog = d
        d.start()

    def follow(g) -> None:
        channel = PlanChannel(g)
        runner = types.SimpleNamespace(group=g, serve=lambda: channel.recv()[0] == STOP or None)
        serve_follower(runner)

    threads = [threading.Thread(target=follow, args=(g,)) for g in groups[1:]]
    for t in threads:
        t.start()
    dogs[0].stop()
    PlanChannel(groups[0]).send(STOP)
    groups[0].wait_followers_left(timeout_s=60)
    assert not any(d.is_alive() for d in dogs[1:])  # both stopped watching before rank 0 may go
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    started = time.monotonic()
    groups[0].wait_followers_left(timeout_s=10)  # every key is there: no wait (a store round trip)
    assert time.monotonic() - started < 5 and not fatal


def _gloo_threads() -> set[int]:
    """The ids of this process's gloo threads. Listing races with threads ending (an earlier
    test's group being collected, any other thread): one gone before its name is read is left out."""
    tids = set()
    for tid in os.listdir("/proc/self/task"):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text()
        except (FileNotFoundError, ProcessLookupError):  # it ended meanwhile
            continue
        if name.startswith(("pt_gloo", "gloo_")):
            tids.add(int(tid))
    return tids


def test_an_orderly_stop_ends_the_process_groups_threads_before_exit():
    """Left to interpreter finalization, a gloo thread holding a finished operation's tensor
    aborts the process (SIGABRT) after a clean stop: shutdown() ends them while Python is whole."""
    before = _gloo_threads()  # earlier tests' groups may still hold theirs (and may end them meanwhile)
    groups = connect_threads(2)
    ops = [threading.Thread(target=g.broadcast, args=(torch.zeros(2, dtype=torch.int64),)) for g in groups]
    for t in ops:
        t.start()
    for t in ops:
        t.join(60)
    assert not any(t.is_alive() for t in ops), "the broadcast did not finish"
    assert _gloo_threads() - before, "the groups started no gloo thread"
    for g in groups:
        g.shutdown()
        g.shutdown()  # twice (a follower's stop, then its exit path) is harmless
    assert not _gloo_threads() - before, "shutdown() returned with gloo threads of its groups still running"
    assert all(g.model_pg is None and g.ctl_pg is None for g in groups)
