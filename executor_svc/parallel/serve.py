"""A tensor-parallel rank's life as a process: join the group, follow or lead, leave in order.

``__main__`` calls :func:`start_group` before loading anything, builds the rank's runner
(``build_runner(cfg, group)``), then either hands rank 0's runner to the worker as usual or,
on the other ranks, calls :func:`serve_follower`; :func:`close_group` runs on the way out.

Start-up order on every rank: rendezvous on the TCPStore; agree on what was loaded (model
fingerprint, block size, dtype, device: a disagreement refuses to start, naming the field);
build the process groups; start the watchdog; then load the shard and size the KV cache to
the minimum over ranks.
"""

from __future__ import annotations

import logging
import signal

import torch

from executor_svc.config import ExecutorConfig
from executor_svc.model import load_model_config, model_fingerprint
from executor_svc.parallel.group import LOOPBACK_HOSTS, TPGroup, make_store
from executor_svc.parallel.launch import die_with_leader, spawn_followers
from executor_svc.parallel.runner import FollowerRunner, TensorParallelRunner
from executor_svc.parallel.shard import TPShard
from executor_svc.parallel.watchdog import Watchdog
from pagedserve import wire

log = logging.getLogger(__name__)

_CHILD_EXIT_S = 10.0  # how long a stopping leader waits for its ranks to exit before killing them


def rank_device(cfg: ExecutorConfig, local_rank: int) -> torch.device:
    """CPU, or GPU ``local_rank`` of those this process sees (CUDA_VISIBLE_DEVICES applies)."""
    if cfg.device != "cuda":
        return torch.device("cpu")
    visible = torch.cuda.device_count()
    if local_rank >= visible:
        raise ValueError(f"--tensor-parallel-size {cfg.tensor_parallel_size} with --device cuda: rank on "
                         f"local GPU {local_rank}, but this process sees {visible} GPU(s) "
                         f"(CUDA_VISIBLE_DEVICES); one GPU per rank")
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def identity(cfg: ExecutorConfig) -> dict[str, str]:
    """What every rank must have in common (the KV budgets may differ: the minimum is used)."""
    return {"model fingerprint": model_fingerprint(cfg.model_dir), "--block-size": str(cfg.block_size),
            "--dtype": cfg.dtype, "--device": cfg.device, "--tensor-parallel-size": str(cfg.tensor_parallel_size),
            "wire version": str(wire.WIRE_VERSION)}


def start_group(cfg: ExecutorConfig, argv: list[str]) -> TPGroup:
    """This process's rank, agreed with the others, connected and watched. Without RANK in the
    environment this process is rank 0 and starts the others on this node (``argv``: its flags)."""
    n, env = cfg.tensor_parallel_size, cfg.rank_env
    TPShard(0, n).check(load_model_config(cfg.model_dir))  # before starting anything: can it split N ways?
    if env is None:
        if cfg.device == "cuda" and torch.cuda.device_count() < n:
            raise ValueError(f"--tensor-parallel-size {n} with --device cuda: one GPU per rank, but this process "
                             f"sees {torch.cuda.device_count()} (CUDA_VISIBLE_DEVICES)")
        store = make_store("127.0.0.1", 0, n, serve=True)
        addr, port = "127.0.0.1", store.port
        group = TPGroup(0, n, store, rank_device(cfg, 0), loopback=True)
        group.children = spawn_followers(argv, n, port)
    else:
        if env.leader_pid is not None:
            die_with_leader(env.leader_pid)
        addr, port = env.master_addr, env.master_port
        store = make_store(addr, port, n, serve=env.rank == 0)
        group = TPGroup(env.rank, n, store, rank_device(cfg, env.local_rank), loopback=addr in LOOPBACK_HOSTS)
    log.info("tensor-parallel rank %d of %d on %s; group store %s:%d", group.rank, n, group.device, addr, port)
    if not group.is_leader:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the leader stops the group on Ctrl-C
    try:
        group.agree(identity(cfg))
        group.connect()
    except BaseException:
        _reap(group)  # they refuse too (same verdict) or, if rank 0 alone failed, are killed
        raise
    group.watchdog = Watchdog(group, addr, port)
    group.watchdog.start()
    if not group.is_leader:  # SIGTERM to any rank drains the whole group, through the leader
        signal.signal(signal.SIGTERM, lambda *_: group.watchdog.request_drain())
    return group


def serve_follower(runner: FollowerRunner, health=None) -> int:
    """Follow the leader until it stops the group (exit 0); a failure exits from inside."""
    if health is not None:
        health.set_ready(True)  # a follower pod (multi-node) is ready once it follows
    log.info("rank %d following the leader", runner.group.rank)
    runner.serve()
    runner.group.watchdog.stop()
    runner.group.shutdown()
    runner.group.mark_left()  # only now may rank 0 take its store down
    log.info("rank %d: the leader stopped the group; exiting", runner.group.rank)
    return 0


def close_group(group: TPGroup, runner: object | None) -> None:
    """Any rank's exit: stop watching; rank 0 also tells the followers to stop, keeps its store up
    until they have left, waits for the ones it started (killed at once if it never finished
    starting, or a step still held them) and ends its process groups. (A follower ended its own
    when STOP came, in :func:`serve_follower`.)"""
    if group.watchdog is not None:
        group.watchdog.stop()
    if isinstance(runner, TensorParallelRunner) and runner.close():
        group.wait_followers_left()
        _reap(group)
        group.shutdown()  # STOP was the last collective
    else:  # a follower, or a rank 0 whose step may still hold a collective: nothing to end here
        _reap(group, patience_s=0.0)


def _reap(group: TPGroup, patience_s: float = _CHILD_EXIT_S) -> None:
    """Wait up to ``patience_s`` for the ranks this process started, then kill what is left."""
    for rank, proc in group.children.items():
        try:
            proc.wait(timeout=patience_s)
        except Exception:  # noqa: BLE001 (TimeoutExpired; kill whatever did not stop)
            log.warning("rank %d (pid %d) did not exit: killing it", rank, proc.pid)
            proc.kill()
            proc.wait()
