"""The serving tier's links go on after a failure that is not theirs: a front's link to a lost core
still redials when moving that core's requests fails, and a child process that cannot be started
for a moment is started again later. A front the scheduler saw exit loses its requests and their
blocks at once, not after the front link's dead-peer interval."""

from __future__ import annotations

import asyncio
import sys
import time

import pytest
import zmq
import zmq.asyncio

from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.wire import DEAD_AFTER_INTERVALS, SamplingParams
from pagedserve.wire import front_messages as m
from scheduler_svc.engine.front_link import FrontLink
from scheduler_svc.entrypoints import children as children_mod
from scheduler_svc.entrypoints.children import Children
from scheduler_svc.front.core_link import RemoteCore
from testing.fake_engine import engine_executor, running
from testing.grpc_fakes import make_tokenizer


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


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="the local front link is an ipc:// socket in a private directory: Linux only")
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

    def popen(cmd, env, pass_fds=()):
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


@pytest.mark.skipif(not sys.platform.startswith("linux"),
                    reason="the local front link is an ipc:// socket in a private directory: Linux only")
def test_a_front_seen_to_exit_loses_its_requests_and_their_blocks_at_once(tmp_path):
    """The scheduler reports a front's exit (``drop_front``, from its child watcher) while the
    front's link still looks alive: it reads, so no send to it fails, and it beats, so it is never
    silent. Its requests must be aborted there and then, and their blocks freed by the next steps,
    well within the dead-peer interval the link would otherwise wait."""
    dead_peer_s = DEAD_AFTER_INTERVALS * m.HEARTBEAT_INTERVAL_S

    async def main():
        async with running(make_tokenizer(), 0) as (engine, _):
            executor = engine_executor(engine, "slow", step_s=0.01)  # the requests run on while the test acts
            link = FrontLink(engine.core, f"ipc://{tmp_path}/front.sock")
            await link.start()
            sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            streaming: set[str] = set()

            async def read() -> None:  # the front reads what the core sends (so no send to it fails)
                while True:
                    msg = m.TIER.decode(await sock.recv())
                    if isinstance(msg, m.Updates):
                        streaming.update(u.request_id for u in msg.updates if any(q.new_token_ids for q in u.seqs))

            async def beat() -> None:  # ... and beats, as a live front does (so it is never silent)
                while True:
                    await sock.send(m.TIER.encode(m.Heartbeat(time.time())))
                    await asyncio.sleep(m.HEARTBEAT_INTERVAL_S)

            tasks: list[asyncio.Task] = []
            try:
                deadline = time.monotonic() + 30
                while not engine.slots:
                    assert time.monotonic() < deadline, "the executor did not register"
                    await asyncio.sleep(0.01)
                sock.connect(link.endpoint)
                await sock.send(m.TIER.encode(m.FrontHello("local-0.1", m.TIER_VERSION)))
                assert m.TIER.decode(await sock.recv()).accepted
                tasks = [asyncio.create_task(read()), asyncio.create_task(beat())]
                ids = [f"local-0.1:{i}" for i in range(4)]
                for i, rid in enumerate(ids):
                    params = RequestParams(max_tokens=600, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
                    await sock.send(m.TIER.encode(m.Submit(GenerationRequest(rid, [], params),
                                                           m.pack_ids(list(range(3, 20 + i))), 0.0)))
                while streaming != set(ids):
                    assert time.monotonic() < deadline, f"only {sorted(streaming)} of the requests streamed"
                    for t in tasks:
                        if t.done():
                            t.result()  # (a failure of the test's front itself)
                    await asyncio.sleep(0.01)
                assert sum(s.scheduler.block_stats()["used"] for s in engine.slots.values()) > 0

                dropped_at = time.monotonic()
                link.drop_front("local-0.1", "exited with status -9")
                assert not [rid for rid in engine.core.requests if rid in ids], "its requests were not aborted"
                assert not link.fronts
                while any(s.scheduler.block_stats()["used"] or s.scheduler.has_work() for s in engine.slots.values()):
                    assert time.monotonic() - dropped_at < dead_peer_s / 2, "its blocks were not freed at once"
                    await asyncio.sleep(0.01)
                for slot in engine.slots.values():
                    slot.scheduler.check_integrity()
            finally:
                for t in tasks:
                    t.cancel()
                sock.close()
                await link.close()
                executor.kill()

    asyncio.run(asyncio.wait_for(main(), 120))
