"""The serving tier's links go on after a failure that is not theirs: a front's link to a lost core
still redials when moving that core's requests fails, and a child process that cannot be started
for a moment is started again later."""

from __future__ import annotations

import asyncio
import sys

import pytest

from scheduler_svc.entrypoints import children as children_mod
from scheduler_svc.entrypoints.children import Children
from scheduler_svc.front.core_link import RemoteCore


class _BrokenSink:
    def __init__(self) -> None:
        self.lost = 0

    def deliver(self, updates) -> None:
        pass

    def status_changed(self, core) -> None:
        pass

    def core_lost(self, core, exc) -> None:
        self.lost += 1
        raise RuntimeError("a bug while moving the lost core's requests")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ipc:// endpoints")
def test_a_front_redials_a_lost_core_even_when_moving_its_requests_fails(tmp_path, caplog):
    async def main():
        core = RemoteCore(f"ipc://{tmp_path}/nobody.sock", "f")
        sink = _BrokenSink()
        core.attach(sink)
        await core.start()
        try:
            first = core._sock
            core.connected = True  # (as if the core had answered, then gone silent)
            core._lost("silent for 2.5s")
            assert sink.lost == 1 and not core.connected
            assert core._sock is not first  # dialling again on a new socket
        finally:
            await core.close()

    asyncio.run(main())
    assert "moving the requests of a lost engine core failed" in caplog.text


class _Proc:
    def __init__(self, returncode: int | None) -> None:
        self.returncode, self.pid = returncode, 4242

    def poll(self) -> int | None:
        return self.returncode


def test_a_child_is_started_again_after_a_failed_start_and_a_failing_exit_hook(monkeypatch, caplog):
    """The first child exits; the exit hook raises; the next start fails (no processes left for a
    moment): the watch goes on and the child is started once that passes."""
    monkeypatch.setattr(children_mod, "RESTART_BACKOFF_S", (0.01,))
    starts = [_Proc(0), OSError(11, "Resource temporarily unavailable"), _Proc(None)]

    def popen(cmd, env):
        nxt = starts.pop(0)
        if isinstance(nxt, Exception):
            raise nxt
        return nxt

    def on_exit(name, why):
        raise RuntimeError("a bug in the exit hook")

    monkeypatch.setattr(children_mod.subprocess, "Popen", popen)

    async def main():
        kids = Children("m", 1, args=lambda c: [], name=lambda c: f"child.{c.generation}", on_exit=on_exit)
        kids.start()
        watch = asyncio.create_task(kids.watch())
        try:
            for _ in range(300):
                if not starts:
                    break
                await asyncio.sleep(0.01)
            assert not starts and not watch.done()
            assert kids.children[0].proc is not None and kids.children[0].proc.poll() is None
        finally:
            kids.stopping = True
            await watch

    asyncio.run(main())
    assert "handling the exit of child.1 failed" in caplog.text and "could not start child.2 again" in caplog.text
