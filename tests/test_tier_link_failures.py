"""The serving tier's links go on after a failure that is not theirs: a front's link to a lost core
still redials when moving that core's requests fails, and a child process that cannot be started
for a moment is started again later."""

from __future__ import annotations

import asyncio
import sys

import pytest

from scheduler_svc.tier.front_link import RemoteCore


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
