"""A Submit's prompt on the front <-> engine core link: packed uint32 ids, bounded, unpacked by the
core in slices with its loop free between them, and handled in the order the front sent it."""

from __future__ import annotations

import asyncio
import sys
import time
from types import SimpleNamespace

import msgspec
import pytest
import zmq
import zmq.asyncio

from pagedserve.engine_api import EngineStats, ErrorKind, GenerationRequest, ModelInfo, RequestParams
from pagedserve.wire import MAX_SEQ_TOKENS, WireError
from pagedserve.wire import front_messages as m
from scheduler_svc.engine import front_link as core_link
from scheduler_svc.front.core_link import RemoteCore

MAX_MODEL_LEN = 200_000


def _submit(rid: str, ids: list[int]) -> m.Submit:
    return m.Submit(GenerationRequest(rid, [], RequestParams(max_tokens=4)), m.pack_ids(ids), 0.0)


@pytest.mark.parametrize("ids", [[], [0], [7, 2**16, 2**31, 2**32 - 1], list(range(100_000, 100_300))])
def test_packed_ids_are_little_endian_uint32s_and_survive_the_codec(ids):
    packed = m.pack_ids(ids)
    assert packed == b"".join(x.to_bytes(4, "little") for x in ids)
    msg = m.TIER.decode(m.TIER.encode(_submit("f:a", ids)), accept=m.FROM_FRONT)
    assert msg.request.prompt_token_ids == [] and m.unpacked(msg.prompt_ids).tolist() == ids


@pytest.mark.parametrize("bad, where", [([1, -1], "[1]"), ([2**32], "[0]"), ([1, 2, "x"], "[2]")])
def test_ids_that_are_not_uint32_are_refused_when_packed_naming_the_first(bad, where):
    with pytest.raises(ValueError, match=rf"prompt_token_ids\{where}: must be a token id in \[0, 2\*\*32\)"):
        m.pack_ids(bad, "prompt_token_ids")


def test_the_codec_bounds_the_packed_ids_and_needs_whole_ids():
    body = [GenerationRequest("f:a", [], RequestParams(max_tokens=4)), b"\0" * (4 * MAX_SEQ_TOKENS + 4), 0.0]
    frame = msgspec.msgpack.encode((m.TIER_VERSION, m.KIND_OF[m.Submit], 0, body))
    with pytest.raises(WireError, match=rf"malformed Submit: .*length <= {4 * MAX_SEQ_TOKENS} \(at submit.prompt_ids\)"):
        m.TIER.decode(frame, accept=m.FROM_FRONT, max_bytes=1 << 30)
    with pytest.raises(WireError, match="6 bytes: not a multiple of 4"):
        m.unpacked(b"\0" * 6)


class _Core:
    """What the front link calls on an engine core: submissions and aborts, recorded in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def submit(self, req, sink, resume=None) -> None:
        assert type(req.prompt_token_ids) is list
        self.calls.append(("submit", req.request_id, req.prompt_token_ids))

    def abort(self, rid: str) -> None:
        self.calls.append(("abort", rid))

    def abort_owned_by(self, sink) -> int:
        return 0

    def finish_choice(self, rid: str, index: int) -> None:
        pass

    def model_info(self) -> ModelInfo:
        return ModelInfo("m", "a", MAX_MODEL_LEN, 1 << 17, 16, 1)

    def is_ready(self) -> bool:
        return True

    def stats(self) -> EngineStats:
        return EngineStats()

    def health_problem(self) -> None:
        return None


async def _linked(tmp_path):
    core = _Core()
    link = core_link.FrontLink(core, f"ipc://{tmp_path}/front.sock")  # type: ignore[arg-type]
    await link.start()
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(link.endpoint)
    await sock.send(m.TIER.encode(m.FrontHello("f", m.TIER_VERSION)))
    assert m.TIER.decode(await sock.recv()).accepted
    assert isinstance(m.TIER.decode(await sock.recv()), m.Status)
    return core, link, sock


async def _until(cond, timeout_s: float = 10.0) -> None:
    for _ in range(int(timeout_s / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("timed out")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ipc:// endpoints")
def test_a_long_prompt_is_unpacked_in_slices_and_what_follows_it_waits(tmp_path, monkeypatch):
    monkeypatch.setattr(core_link, "UNPACK_SLICE", 1_000)
    long = [(i * 7919) % (1 << 17) for i in range(150_000)]
    unpacking = []  # set once the core starts on the long prompt's ids
    monkeypatch.setattr(m, "unpacked", lambda data, f=m.unpacked: unpacking.append(1) or f(data))

    async def main():
        core, link, sock = await _linked(tmp_path)
        turns = 0

        async def ticker():  # counts the loop's turns while the prompt is unpacked
            nonlocal turns
            while True:
                turns += bool(unpacking and not core.calls)
                await asyncio.sleep(0)

        tick = asyncio.create_task(ticker())
        try:
            for msg in (_submit("f:long", long), m.Abort("f:long"), _submit("f:short", [5, 6])):
                await sock.send(m.TIER.encode(msg))
            await _until(lambda: len(core.calls) == 3)
        finally:
            tick.cancel()
            sock.close()
            await link.close()
        assert core.calls == [("submit", "f:long", long), ("abort", "f:long"), ("submit", "f:short", [5, 6])]
        assert turns >= 100  # the loop turned between the 150 slices

    asyncio.run(main())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ipc:// endpoints")
def test_a_prompt_longer_than_the_context_is_refused_unread_and_broken_ids_drop_the_front(tmp_path, monkeypatch):
    unpacked = []
    monkeypatch.setattr(core_link, "_ints", lambda ids, vocab_size: unpacked.append(ids))  # (must not be reached)

    async def main():
        core, link, sock = await _linked(tmp_path)
        try:
            await sock.send(m.TIER.encode(_submit("f:long", [1] * MAX_MODEL_LEN)))
            reply = m.TIER.decode(await sock.recv())
            while not isinstance(reply, m.Updates):
                reply = m.TIER.decode(await sock.recv())
            (u,) = reply.updates
            assert (u.request_id, u.finished, u.error_kind) == ("f:long", True, ErrorKind.INVALID)
            assert u.error.startswith(f"prompt_token_ids: This model's maximum context length is {MAX_MODEL_LEN} "
                                      f"tokens. However, the prompt has {MAX_MODEL_LEN} tokens")
            assert link.fronts
            odd = m.TIER.encode(_submit("f:odd", [])).replace(b"\xc4\x00", b"\xc4\x03abc")
            assert m.TIER.decode(odd, accept=m.FROM_FRONT).prompt_ids == b"abc"
            await sock.send(odd)
            await _until(lambda: not link.fronts)  # broke the protocol: dropped
        finally:
            sock.close()
            await link.close()
        assert core.calls == [] and unpacked == []

    asyncio.run(main())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ipc:// endpoints")
def test_a_bug_while_handling_a_submit_is_logged_and_the_link_goes_on(tmp_path, monkeypatch, caplog):
    async def main():
        core, link, sock = await _linked(tmp_path)
        real = core.submit
        monkeypatch.setattr(core, "submit", lambda req, sink, resume=None: 1 / 0 if req.request_id == "f:bug"
                            else real(req, sink, resume))
        try:
            await sock.send(m.TIER.encode(_submit("f:bug", [1])))
            await sock.send(m.TIER.encode(_submit("f:next", [2])))
            await _until(lambda: core.calls)
        finally:
            sock.close()
            await link.close()
        assert core.calls == [("submit", "f:next", [2])] and link.failure is None

    asyncio.run(main())
    assert "error while handling a front's frame: Traceback" in caplog.text and "ZeroDivisionError" in caplog.text


def _drops_the_front(tmp_path, msg: m.Submit) -> None:
    """The front that sends ``msg`` is dropped, and nothing of it reaches the core."""
    async def main():
        core, link, sock = await _linked(tmp_path)
        try:
            await sock.send(m.TIER.encode(msg))
            await _until(lambda: not link.fronts)
        finally:
            sock.close()
            await link.close()
        assert core.calls == []

    asyncio.run(main())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ipc:// endpoints")
def test_a_submit_carrying_its_ids_unpacked_drops_the_front(tmp_path):
    _drops_the_front(tmp_path, m.Submit(GenerationRequest("f:x", [1, 2], RequestParams(max_tokens=4)), b"", 0.0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ipc:// endpoints")
@pytest.mark.parametrize("finished, where", [([99], "int` <= 4"), ([0], "int` >= 1")],
                         ids=["not-a-finish-reason", "unspecified"])
def test_a_resumed_submit_with_a_broken_finish_reason_drops_the_front(tmp_path, finished, where, caplog):
    msg = _submit("f:x", [1, 2])
    msg.resume_outputs, msg.resume_finished = [[3]], finished
    _drops_the_front(tmp_path, msg)
    assert "front f dropped (broke the front protocol: malformed Submit: Expected `" + where in caplog.text
    assert "(at submit.resume_finished[0])" in caplog.text


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ipc:// endpoints")
@pytest.mark.parametrize("prompt, resume, error", [
    ([5] * 40_000 + [1 << 17], None, "prompt_token_ids[40000]: must be a token id in [0, vocab_size=131072) "
                                     "(got 131072)"),
    ([5, 6], [[7], [8, 1 << 17]], "resume_outputs[1][1]: must be a token id in [0, vocab_size=131072) "
                                  "(got 131072)"),
], ids=["prompt", "resumed-outputs"])
def test_an_id_outside_the_vocabulary_fails_its_request_alone(tmp_path, monkeypatch, prompt, resume, error):
    """Such an id would have the executor refuse the whole plan carrying it, moving every request in it."""
    monkeypatch.setattr(core_link, "UNPACK_SLICE", 16_384)

    async def main():
        core, link, sock = await _linked(tmp_path)
        try:
            bad = _submit("f:bad", prompt)
            if resume is not None:
                bad.resume_outputs, bad.request.params.n = resume, len(resume)
            for msg in (bad, _submit("f:good", [5, 6])):
                await sock.send(m.TIER.encode(msg))
            reply = m.TIER.decode(await asyncio.wait_for(sock.recv(), 10))
            while not isinstance(reply, m.Updates):
                reply = m.TIER.decode(await asyncio.wait_for(sock.recv(), 10))
            (u,) = reply.updates
            assert (u.request_id, u.finished, u.error_kind, u.error) == ("f:bad", True, ErrorKind.INVALID, error)
            await _until(lambda: core.calls == [("submit", "f:good", [5, 6])])
            assert link.fronts  # the front stays
        finally:
            sock.close()
            await link.close()

    asyncio.run(main())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ipc:// endpoints")
def test_a_deadline_past_the_links_bound_reaches_the_core_as_the_longest_it_carries(tmp_path):
    """grpc core lets a client send ``grpc-timeout: 99999999H`` (3.6e11 s, context.time_remaining()
    says so): its Submit must still decode on the core, or the core drops the front and with it every
    other request the front holds."""
    sent: list[bytes] = []
    front = RemoteCore("ipc://unused", "f")
    front.connected, front.status = True, m.Status(True, None, EngineStats())
    front._sock = SimpleNamespace(send_multipart=lambda frames: sent.append(frames[-1]))  # type: ignore[assignment]
    req = GenerationRequest("f:far", [5, 6], RequestParams(max_tokens=4))
    req.deadline = time.monotonic() + 99_999_999 * 3600
    front.submit(req, None)
    (frame,) = sent
    assert m.TIER.decode(frame, accept=m.FROM_FRONT).deadline_in_s == m.MAX_SECONDS

    async def main():
        core, link, sock = await _linked(tmp_path)
        try:
            await sock.send(frame)
            await _until(lambda: core.calls)
            assert link.fronts  # the front (and every request it holds) stays
        finally:
            sock.close()
            await link.close()
        assert core.calls == [("submit", "f:far", [5, 6])]

    asyncio.run(main())
