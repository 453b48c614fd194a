"""A tensor-parallel group: rendezvous, agreement at start-up, collectives, and the way out.

Rank 0 hosts a ``torch.distributed.TCPStore`` at MASTER_ADDR:MASTER_PORT; every rank connects
to it. Start-up exchanges (what each rank loaded, how many KV blocks it can hold) go through the
store as plain strings: no pickle, and no collective timeout while ranks load weights at
different speeds. Then two process groups, built as objects rather than torch's global default
group (so tests can run several ranks as threads of one process):

- ``model_pg``: the activations' all-reduce (gloo on CPU, NCCL on CUDA);
- ``ctl_pg``: the plan channel (executor_svc/parallel/channel.py), always gloo on host memory.

Every collective has a timeout (:data:`COLLECTIVE_TIMEOUT_S`). A rank whose collective fails,
times out, or whose peer died cannot continue: its partners are mid-step and its state is
unknown. :meth:`TPGroup.fatal` logs why and exits the process (killing the ranks it started);
the scheduler then sees the executor go silent and migrates its requests.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NoReturn

import torch
import torch.distributed as dist

from executor_svc.parallel.shard import TPShard
from executor_svc.runner import StepFatal

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 60.0  # one collective; idle followers stay under it thanks to the leader's ticks
START_TIMEOUT_S = 900.0  # ranks reaching a start-up exchange (loading a large shard takes minutes)
EXIT_GROUP_FAILED = 3  # process exit status after a group failure
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
LEAVE_TIMEOUT_S = 5.0  # a stopping rank 0 keeps its store up this long for the followers to leave


class GroupFailure(StepFatal):
    """Raised instead of exiting when a test asked for it (``on_fatal``)."""


def _exit_process(reason: str) -> NoReturn:  # the default on_fatal
    os._exit(EXIT_GROUP_FAILED)  # other threads may be stuck in a collective: no orderly unwinding


def make_store(addr: str, port: int, size: int, *, serve: bool, timeout_s: float = START_TIMEOUT_S) -> dist.TCPStore:
    """Rank 0 serves the store (``serve``; ``port`` 0 picks a free one); clients connect, retrying
    for ``timeout_s``, which is also how long their store calls may wait."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if serve and addr in LOOPBACK_HOSTS:
        # TCPStore itself listens on every interface whatever ``addr`` says, and the store is
        # unauthenticated (anyone could write a drain or a heartbeat): a single-node group's store
        # listens on a socket bound to loopback, handed over by its descriptor.
        sock = socket.create_server(("::1" if addr == "::1" else "127.0.0.1", port), backlog=128)
        port = sock.getsockname()[1]
        return dist.TCPStore(addr, port, size, is_master=True, timeout=timeout, wait_for_workers=False,
                             master_listen_fd=sock.detach())
    if serve:
        return dist.TCPStore(addr, port, size, is_master=True, timeout=timeout, wait_for_workers=False)
    return dist.TCPStore(addr, port, size, is_master=False, timeout=timeout)


def _gloo(store: dist.Store, rank: int, size: int, loopback: bool, timeout_s: float) -> dist.ProcessGroupGloo:
    timeout = datetime.timedelta(seconds=timeout_s)
    if not loopback:  # this constructor honours GLOO_SOCKET_IFNAME, else the hostname's address
        return dist.ProcessGroupGloo(store, rank, size, timeout)
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, size, opts)


def _nccl(store: dist.Store, rank: int, size: int, timeout_s: float):
    from torch.distributed import ProcessGroupNCCL  # absent from CPU builds of torch

    opts = ProcessGroupNCCL.Options()
    opts._timeout = datetime.timedelta(seconds=timeout_s)
    return ProcessGroupNCCL(store, rank, size, opts)


class TPGroup:
    """One rank's view of its group. ``children``: ranks this process started (the local leader)."""

    def __init__(self, rank: int, size: int, store: dist.Store, device: torch.device, *, loopback: bool,
                 on_fatal: Callable[[str], object] | None = None,
                 collective_timeout_s: float = COLLECTIVE_TIMEOUT_S) -> None:
        self.shard = TPShard(rank, size)
        self.rank, self.size, self.store, self.device = rank, size, store, device
        self.loopback, self.collective_timeout_s = loopback, collective_timeout_s
        self.children: dict[int, subprocess.Popen] = {}  # rank -> process, on a local leader
        self._on_fatal = on_fatal or _exit_process
        self.model_pg = None
        self.ctl_pg = None
        self.watchdog = None  # executor_svc/parallel/watchdog.py, started once connected
        self._rounds: dict[str, int] = {}  # exchange key -> times used

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    # ---------------------------------------------------------------- start-up

    def exchange(self, key: str, value: str, timeout_s: float = START_TIMEOUT_S) -> list[str]:
        """Every rank's ``value`` for ``key``, in rank order (an all-gather through the store).
        Rank 0 returns only once every rank has read them: it hosts the store, and a rank that
        exits right after (a refusal) must not take the answers with it."""
        timeout = datetime.timedelta(seconds=timeout_s)
        n = self._rounds[key] = self._rounds.get(key, -1) + 1  # the store's keys are written once
        prefix = f"tp/{key}/{n}"
        self.store.set(f"{prefix}/{self.rank}", value)
        keys = [f"{prefix}/{r}" for r in range(self.size)]
        self._wait(keys, timeout, f"reach start-up step {key!r}")
        values = [self.store.get(k).decode() for k in keys]
        self.store.set(f"{prefix}/read/{self.rank}", "1")
        if self.is_leader:
            self._wait([f"{prefix}/read/{r}" for r in range(self.size)], timeout, f"read start-up step {key!r}")
        return values

    def _wait(self, keys: list[str], timeout: datetime.timedelta, what: str) -> None:
        """Wait for ``keys`` in slices of a second, so a rank that died meanwhile (one this process
        started, or rank 0 and its store) ends the wait at once instead of at the timeout."""
        deadline = time.monotonic() + timeout.total_seconds()
        while True:
            try:
                self.store.wait(keys, datetime.timedelta(seconds=max(0.01, min(1.0, deadline - time.monotonic()))))
                return
            except Exception as exc:  # noqa: BLE001 (DistStoreError and friends: say who is missing)
                dead = {r: p.returncode for r, p in self.children.items() if p.poll() is not None}
                if dead:
                    raise ValueError(f"tensor-parallel group: rank(s) {', '.join(map(str, dead))} exited during "
                                     f"start-up (status {', '.join(map(str, dead.values()))}); see their log lines"
                                     ) from None
                if not self._reachable():
                    raise ValueError(f"tensor-parallel group: lost rank 0's store ({type(exc).__name__}: {exc})"
                                     ) from None
                missing = [k.rsplit("/", 1)[-1] for k in keys if not self._has(k)]
                if time.monotonic() >= deadline:
                    raise ValueError(
                        f"tensor-parallel group: rank(s) {', '.join(missing)} did not {what} within "
                        f"{timeout.total_seconds():.0f}s; are all {self.size} ranks started, with the same "
                        f"MASTER_ADDR and MASTER_PORT?") from None

    def _has(self, key: str) -> bool:
        try:
            return self.store.check([key])
        except Exception:  # noqa: BLE001 (the store itself is gone: nothing can be said)
            return False

    def _reachable(self) -> bool:
        """False when rank 0's store no longer answers (a missing key is not an error)."""
        try:
            self.store.check(["tp/ping"])
            return True
        except Exception:  # noqa: BLE001
            return False

    def agree(self, identity: dict[str, str]) -> None:
        """ValueError on every rank, naming the field and both values, unless all ranks loaded the
        same thing (model fingerprint, block size, dtype, ...)."""
        every = [json.loads(text) for text in self.exchange("identity", json.dumps(identity, sort_keys=True))]
        lead = every[0]
        for r, theirs in enumerate(every[1:], start=1):
            for field in sorted(set(lead) | set(theirs)):
                if lead.get(field) != theirs.get(field):
                    raise ValueError(
                        f"tensor-parallel group refuses to start: rank {r} has {field} {theirs.get(field)!r} "
                        f"but rank 0 has {lead.get(field)!r}; every rank must load the same --model with the "
                        f"same --block-size, --dtype and --device")

    def min_over_ranks(self, key: str, values: tuple[int, ...]) -> tuple[int, ...]:
        """Elementwise minimum of every rank's ``values`` (e.g. KV blocks each can hold)."""
        rows = [tuple(int(x) for x in text.split(",")) for text in self.exchange(key, ",".join(map(str, values)))]
        return tuple(min(col) for col in zip(*rows, strict=True))

    def connect(self) -> None:
        """Build the process groups (every rank calls this at the same point)."""
        model_store = dist.PrefixStore("tp/model", self.store)
        ctl_store = dist.PrefixStore("tp/ctl", self.store)
        t = self.collective_timeout_s
        if self.device.type == "cuda":
            self.model_pg = _nccl(model_store, self.rank, self.size, t)
        else:
            self.model_pg = _gloo(model_store, self.rank, self.size, self.loopback, t)
        self.ctl_pg = _gloo(ctl_store, self.rank, self.size, self.loopback, t)

    # ---------------------------------------------------------------- collectives

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns it (the model's row-parallel layers).

        On CPUs every rank gathers the partial products and adds them in rank order: a row's sum
        is then the same whatever rows share the step (gloo's ring cuts the buffer by its size, so
        with more than two ranks an element's order of additions moved with the row count), and
        identical on every rank. NCCL keeps its all-reduce."""
        if self.device.type == "cuda":
            self.model_pg.allreduce([t]).wait()
            return t
        parts = [torch.empty_like(t) for _ in range(self.size)]
        self.model_pg.allgather([parts], [t]).wait()
        t.copy_(parts[0])
        for p in parts[1:]:
            t.add_(p)
        return t

    def control_max(self, t: torch.Tensor) -> torch.Tensor:
        """The element-wise maximum of ``t`` over the ranks, in place, on the control group (host data)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MAX
        self.ctl_pg.allreduce([t], opts).wait()
        return t

    def broadcast(self, t: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``t`` into every rank's (same shape and dtype), on the control group."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.ctl_pg.broadcast([t], opts).wait()
        return t

    # ---------------------------------------------------------------- an orderly stop

    def mark_left(self) -> None:
        """A follower that got STOP and stopped its watchdog says so: rank 0 may take the store down."""
        try:
            self.store.set(f"tp/left/{self.rank}", "1")
        except Exception:  # noqa: BLE001 (rank 0 is gone already: there is no one to tell)
            pass

    def shutdown(self) -> None:
        """An orderly stop, once no collective can be in flight: end the process groups' threads
        while the interpreter is whole. Left to finalization, a backend thread still holding a
        finished operation's tensor must take the GIL of an interpreter being torn down, and the
        process aborts (SIGABRT) after a clean stop (pytorch/pytorch#179291)."""
        for pg in (self.model_pg, self.ctl_pg):
            if pg is not None:
                try:
                    pg.shutdown()
                except Exception as exc:  # noqa: BLE001 (a peer already gone: nothing left to end)
                    log.debug("tensor-parallel rank %d: process group shutdown: %s", self.rank, exc)
        self.model_pg = self.ctl_pg = None

    def wait_followers_left(self, timeout_s: float = LEAVE_TIMEOUT_S) -> None:
        """Rank 0, after sending STOP: keep the store up until every follower has stopped watching
        it. A follower on another node is not this process's child, and a watchdog that found the
        store gone before its STOP arrived would call a normal stop a group failure (exit 3)."""
        keys = [f"tp/left/{r}" for r in range(1, self.size)]
        try:
            self.store.wait(keys, datetime.timedelta(seconds=timeout_s))
        except Exception as exc:  # noqa: BLE001 (a follower died meanwhile: stopping is all that is left)
            missing = [k.rsplit("/", 1)[-1] for k in keys if not self._has(k)]
            log.warning("rank(s) %s did not confirm the stop within %.0fs (%s); stopping anyway",
                        ", ".join(missing), timeout_s, type(exc).__name__)

    # ---------------------------------------------------------------- failure

    def fatal(self, reason: str) -> NoReturn:
        """Leave at once: log why, kill the ranks this process started, exit (or raise in tests)."""
        log.critical("tensor-parallel rank %d of %d: %s; leaving the group (exit %d) so the scheduler "
                     "moves this executor's requests elsewhere", self.rank, self.size, reason, EXIT_GROUP_FAILED)
        self.kill_children()
        for handler in logging.getLogger().handlers:
            handler.flush()
        self._on_fatal(reason)
        raise GroupFailure(reason)  # on_fatal returned (tests): never continue a broken group

    @contextmanager
    def fatal_on_error(self, what: str) -> Iterator[None]:
        """Any exception in the block is a group failure (ranks mid-collective cannot recover)."""
        try:
            yield
        except GroupFailure:
            raise
        except Exception as exc:
            self.fatal(f"{what}: {type(exc).__name__}: {exc}")

    def kill_children(self) -> None:
        for p in self.children.values():
            if p.poll() is None:
                p.kill()
