"""The executor directory of a scheduler with several engine cores (OtherCores.director): each
executor goes to the core with the fewest, a core still starting takes its share, a lost one none."""

from __future__ import annotations

from types import SimpleNamespace

from pagedserve.engine_api import EngineStats, ExecutorStats
from pagedserve.wire import front_messages as m
from scheduler_svc.entrypoints import other_cores
from scheduler_svc.entrypoints.other_cores import OtherCores

PORT = 7000


def _directory(cores: int) -> tuple[OtherCores, SimpleNamespace]:
    core0 = SimpleNamespace(slots={})
    return OtherCores(core0, [f"ipc:///nonexistent/core-{k}" for k in range(1, cores)], PORT), core0


def _joins_core0(core0: SimpleNamespace, name: str) -> None:
    core0.slots[name] = SimpleNamespace(conn=SimpleNamespace(state="ready"))


def _answers(peer, executors: int) -> None:
    stats = EngineStats(executors=[ExecutorStats(f"e{i}", "ready", 8, 0, 0, 0, 0, 0) for i in range(executors)])
    peer.status, peer.connected = m.Status(True, None, stats), True


def _send(directory: OtherCores, core0: SimpleNamespace, name: str) -> int:
    """The core ``name`` goes to (core 0 registers it at once, as its hub does)."""
    port = directory.director(None)
    if port is None:
        _joins_core0(core0, name)
        return 0
    return port - PORT


def test_executors_up_before_the_cores_are_spread_over_the_starting_cores():
    directory, core0 = _directory(3)
    assert [_send(directory, core0, f"ex{i}") for i in range(6)] == [0, 1, 2, 0, 1, 2]
    # A Status counts the executors the core has; those sent since are counted on top.
    _answers(directory.peers[0], 2)
    directory.status_changed(directory.peers[0])
    assert directory.sent[1] == 0
    assert _send(directory, core0, "ex6") == 0  # (2, 2, 2: a tie goes to the lowest index)
    _answers(directory.peers[0], 1)  # (core 1 lost one)
    assert _send(directory, core0, "ex7") == 1


def test_a_core_silent_past_the_grace_or_lost_gets_no_executor(monkeypatch):
    directory, core0 = _directory(2)
    monkeypatch.setattr(other_cores.time, "monotonic", lambda: directory._started + other_cores.STARTING_GRACE_S)
    assert [_send(directory, core0, f"ex{i}") for i in range(3)] == [0, 0, 0]  # never answered: not starting
    _answers(directory.peers[0], 0)
    assert _send(directory, core0, "ex3") == 1
    directory.peers[0].connected = False  # lost (it answered once, so it is not starting either)
    assert _send(directory, core0, "ex4") == 0


def test_a_restarted_core_is_told_by_its_incarnation_and_its_former_counts_stay():
    """Core 0 sums the other cores' counters. A core restarted (another incarnation in its
    CoreHello) counts from 0 again: what it had counted stays, even when the new process has
    already passed its former totals by the first poll (no counter fell to tell it)."""
    import asyncio

    directory, _ = _directory(2)
    peer = directory.peers[0]
    counted = [0.0]

    async def families(timeout_s: float) -> list:
        return [("pagedserve:generation_tokens", "counter", "Tokens generated.",
                 [("pagedserve:generation_tokens_total", [], counted[0])])]

    peer.families, peer.connected = families, True

    def total() -> float:
        return sum(v for f in directory.families() for _, _, v in f[3])

    peer.incarnation, counted[0] = 5, 40.0
    asyncio.run(directory.poll_metrics_once())
    peer.incarnation, counted[0] = 5, 50.0  # the same process
    asyncio.run(directory.poll_metrics_once())
    assert total() == 50
    peer.incarnation, counted[0] = 6, 70.0  # restarted, and past its former 50 by the next poll
    asyncio.run(directory.poll_metrics_once())
    assert total() == 120
