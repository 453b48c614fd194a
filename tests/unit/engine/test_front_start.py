"""A front that cannot start stops the scheduler, saying why; one that served is started again."""

from __future__ import annotations

import asyncio
import os

import pytest

from scheduler_svc.entrypoints import children as children_mod
from scheduler_svc.entrypoints import front_ready
from scheduler_svc.entrypoints.children import Children


class _Proc:
    def __init__(self, returncode: int | None = None) -> None:
        self.returncode, self.pid = returncode, 4242

    def poll(self) -> int | None:
        return self.returncode


def _fronts(monkeypatch, said: list[bytes | None], exits: list[int | None]) -> tuple[Children, list[_Proc]]:
    """Children whose n-th start writes ``said[n]`` on its ready pipe (None: nothing) and runs until the
    test sets its returncode (``exits[n]``: already exited)."""
    procs: list[_Proc] = []

    def popen(cmd, env, pass_fds=()):
        n = len(procs)
        assert pass_fds == (int(env[front_ready.READY_FD]),)
        if said[n] is not None:
            os.write(pass_fds[0], said[n])
        procs.append(_Proc(exits[n]))
        return procs[-1]

    monkeypatch.setattr(children_mod.subprocess, "Popen", popen)
    monkeypatch.setattr(children_mod, "RESTART_BACKOFF_S", (0.01,))
    exited: list[str] = []
    kids = Children("m", 1, args=lambda c: [], name=lambda c: f"local-0.{c.generation}",
                    on_exit=lambda name, why: exited.append(name), ready_pipes=True)
    return kids, procs


def test_a_front_that_exits_before_it_was_ready_is_not_started_again_and_says_why(monkeypatch, caplog):
    kids, procs = _fronts(monkeypatch, [b"failed --port 55051 on --host 999.1.1.1: cannot serve there\n"], [1])

    async def main():
        kids.start()
        watch = asyncio.create_task(kids.watch())
        failure = await asyncio.wait_for(kids.wait_ready(), 5)
        await asyncio.sleep(0.2)  # (a restart would come within the 0.01 s backoff)
        kids.stopping = True
        await watch
        return failure

    assert asyncio.run(main()) == "local-0.1 could not start: --port 55051 on --host 999.1.1.1: cannot serve there"
    assert len(procs) == 1 and "starting it again" not in caplog.text


def test_without_a_reason_the_exit_status_is_the_reason(monkeypatch):
    kids, procs = _fronts(monkeypatch, [None], [2])

    async def main():
        kids.start()
        watch = asyncio.create_task(kids.watch())
        failure = await asyncio.wait_for(kids.wait_ready(), 5)
        kids.stopping = True
        await watch
        return failure

    assert asyncio.run(main()) == "local-0.1 could not start: exited with status 2"


def test_a_front_that_was_ready_and_then_exits_is_started_again(monkeypatch, caplog):
    kids, procs = _fronts(monkeypatch, [b"ready\n", b"failed --port: in use\n", b"ready\n"], [None, 1, None])

    async def main():
        kids.start()
        watch = asyncio.create_task(kids.watch())
        assert await asyncio.wait_for(kids.wait_ready(), 5) is None
        procs[0].returncode = -9  # it served, then crashed: restarted, even when a restart fails to start
        for _ in range(300):
            if len(procs) == 3:
                break
            await asyncio.sleep(0.01)
        kids.stopping = True
        await watch

    asyncio.run(main())
    assert len(procs) == 3 and kids.failure is None
    assert "local-0.1 exited with status -9; starting it again" in caplog.text
    assert "local-0.2 exited with status 1; starting it again" in caplog.text


@pytest.mark.parametrize("exc,reason", [
    (SystemExit("--model: bad template"), b"failed --model: bad template\n"),
    (SystemExit(2), b"failed exited with status 2\n"),
    (RuntimeError("Failed to bind"), b"failed RuntimeError: Failed to bind\n"),
])
def test_a_front_reports_its_failure_once_on_the_pipe(monkeypatch, exc, reason):
    r, w = os.pipe()
    monkeypatch.setenv(front_ready.READY_FD, str(w))
    front_ready.report_failure(exc)
    front_ready.report_ready()  # (the variable is gone: nothing more is written, nor a closed fd touched)
    assert os.read(r, 4096) == reason and os.read(r, 4096) == b""
    os.close(r)
