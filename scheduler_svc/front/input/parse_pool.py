"""A front's large requests, decoded and checked off its event loop by the parse worker.

One worker process per front process (both fronts of it share it: :func:`shared_worker`), started
on the first large request and restarted when it dies; it decodes one request at a time. What a
front hands it is bounded: at most ``QUEUE_BYTES`` of requests wait or are being decoded, a
request waits at most ``WAIT_S`` for its turn, and a decode may take ``DECODE_TIMEOUT_S`` before
the worker is killed and started again. Past any of these the request is refused with
:class:`ParserBusy` (503 with ``Retry-After`` over HTTP, UNAVAILABLE over gRPC), its bytes dropped.
The front's own cost is writing the request into a pipe and reading the reply, a few milliseconds
at most, so a flood of large requests costs a benign request CPU time, not event-loop time.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
from pathlib import Path
from typing import Any

import msgspec

from scheduler_svc.front.input.parse_worker import FAILED, HEADER, OK, REFUSED  # noqa: F401  (re-exported)

log = logging.getLogger(__name__)

QUEUE_BYTES = 16 << 20  # five maximum-size bodies at 131,072 tokens (3 MiB each)
WAIT_S = 2.0
DECODE_TIMEOUT_S = 10.0  # far above any decode of a capped body (about 50 ms)
RETRY_AFTER_S = 1
WRITE_SLICE = 256 << 10
_ROOT = str(Path(__file__).resolve().parents[3])  # the tree this front was imported from
_BOOT = "import sys; sys.path.insert(0, sys.argv[1]); from scheduler_svc.front.input.parse_worker import main; main()"


class ParserBusy(Exception):
    """The worker cannot take this request now (its queue is full, its turn did not come in time,
    or the worker failed); the client should retry shortly."""


class ParseWorker:
    def __init__(self, queue_bytes: int = QUEUE_BYTES, wait_s: float = WAIT_S,
                 decode_timeout_s: float = DECODE_TIMEOUT_S) -> None:
        self.queue_bytes, self.wait_s, self.decode_timeout_s = queue_bytes, wait_s, decode_timeout_s
        self._turn = asyncio.Lock()  # FIFO: one request in the worker at a time
        self._proc: asyncio.subprocess.Process | None = None
        self.queued = 0  # bytes of requests waiting or being decoded
        self.handled = 0  # requests the worker answered (tests and metrics)
        self.starts = 0

    def check_room(self, size: int) -> None:
        """ParserBusy unless a request of ``size`` bytes fits the queue now: a front asks before it
        reads a large body, so a flood past the queue is refused unread."""
        if self.queued + size > self.queue_bytes:
            raise ParserBusy(f"{self.queued} bytes of large requests are already waiting to be decoded")

    async def run(self, kind: str, caps: list[int], body: bytes) -> tuple[int, Any]:
        """The worker's reply to one request, ``(OK | REFUSED | FAILED, payload)``; ParserBusy."""
        self.check_room(len(body))
        self.queued += len(body)
        try:
            try:
                await asyncio.wait_for(self._turn.acquire(), self.wait_s)
            except (TimeoutError, asyncio.TimeoutError):
                raise ParserBusy(f"a large request waited over {self.wait_s:g}s to be decoded") from None
            try:
                return await self._exchange(msgspec.msgpack.encode([kind, caps, len(body)]), body)
            finally:
                self._turn.release()
        finally:
            self.queued -= len(body)

    async def _exchange(self, head: bytes, body: bytes) -> tuple[int, Any]:
        proc = await self._running()
        assert proc.stdin is not None and proc.stdout is not None
        try:
            async with asyncio.timeout(self.decode_timeout_s):
                proc.stdin.write(HEADER.pack(len(head)) + head)
                view = memoryview(body)
                for start in range(0, len(body), WRITE_SLICE):  # a whole body at once would be copied
                    proc.stdin.write(view[start:start + WRITE_SLICE])  # into the pipe's buffer on the loop
                    await proc.stdin.drain()
                (size,) = HEADER.unpack(await proc.stdout.readexactly(HEADER.size))
                status, payload = msgspec.msgpack.decode(await proc.stdout.readexactly(size))
        except (TimeoutError, OSError, asyncio.IncompleteReadError) as e:
            log.warning("the parse worker failed (%s); starting a new one", type(e).__name__)
            await self.close()
            raise ParserBusy("the request parser restarted") from None
        self.handled += 1
        return status, payload

    async def _running(self) -> asyncio.subprocess.Process:
        if self._proc is None or self._proc.returncode is not None:
            self._proc = await asyncio.create_subprocess_exec(
                sys.executable, "-c", _BOOT, _ROOT, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE)
            self.starts += 1
            log.info("parse worker started (pid %d)", self._proc.pid)
        return self._proc

    async def start(self) -> None:
        """Start the worker now rather than on the first large request."""
        await self._running()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None and self._proc.returncode is None else None

    async def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


_workers: dict[asyncio.AbstractEventLoop, ParseWorker] = {}


def shared_worker() -> ParseWorker:
    """The running loop's worker: one per front process, both its fronts' requests in one queue."""
    loop = asyncio.get_running_loop()
    worker = _workers.get(loop)
    if worker is None:
        for old in [lp for lp in _workers if lp.is_closed()]:
            del _workers[old]
        worker = _workers[loop] = ParseWorker()
    return worker
