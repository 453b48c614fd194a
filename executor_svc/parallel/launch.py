"""Starting the other ranks of a group on this node, and tying their lives to the leader's.

``pagedserve-executor --tensor-parallel-size N`` with no ``RANK`` in the environment leads: it
serves the group's TCPStore on a free loopback port and starts ranks 1..N-1 as child processes
running the same command line, with torch.distributed's variables set (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), ``--health-port 0`` (one
health server per group: the leader's) and the leader's pid. Exactly what a multi-node
deployment sets by hand or through its launcher, so both forms run the same code.

Children run in their own session: a terminal's Ctrl-C reaches the leader only, which stops
the group in order. Each child asks the kernel to SIGKILL it when the leader dies
(``PR_SET_PDEATHSIG``), so a kill -9 of the leader leaves no orphan; the leader's watchdog
(executor_svc/parallel/watchdog.py) sees a child die within a fraction of a second.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys

from executor_svc.config import LEADER_PID_ENV
from executor_svc.parallel.group import EXIT_GROUP_FAILED

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def follower_env(rank: int, size: int, port: int, base: dict[str, str]) -> dict[str, str]:
    return {**base, "RANK": str(rank), "WORLD_SIZE": str(size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            LEADER_PID_ENV: str(os.getpid())}


def follower_argv(argv: list[str]) -> list[str]:
    """The leader's own flags (argparse keeps the last of a repeated flag), no health server."""
    return [sys.executable, "-m", "executor_svc", *argv, "--health-port", "0"]


def spawn_followers(argv: list[str], size: int, port: int) -> dict[int, subprocess.Popen]:
    """Ranks 1..size-1 of a group whose store listens on 127.0.0.1:``port``; rank -> process."""
    children: dict[int, subprocess.Popen] = {}
    for rank in range(1, size):
        env = follower_env(rank, size, port, dict(os.environ))
        children[rank] = subprocess.Popen(follower_argv(argv), env=env, start_new_session=True)
        log.info("started tensor-parallel rank %d of %d (pid %d)", rank, size, children[rank].pid)
    return children


def die_with_leader(leader_pid: int) -> None:
    """SIGKILL this process when the leader that started it exits (Linux); exit at once if it
    already has (the request only covers a parent that is still alive)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d): the watchdog alone ties this rank "
                        "to its leader", ctypes.get_errno())
    if os.getppid() != leader_pid:
        log.critical("the leader (pid %d) exited before this rank started", leader_pid)
        os._exit(EXIT_GROUP_FAILED)
