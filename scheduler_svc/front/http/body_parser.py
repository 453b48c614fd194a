"""JSON request bodies decoded without letting large ones stack up on the front's event loop.

msgspec decodes at about 200 MB/s and holds the GIL for the whole call, so a worker thread
would stall the loop just as long (measured: a 43 ms decode in ``asyncio.to_thread`` stopped
the loop for 47 ms). What bounds a stall is therefore the size of one decode, and what bounds a
benign request's wait is how many of them run before it:

* one decode is at most the body cap (``limits.body_cap``: 3 MiB at 131,072 tokens, about 15 ms
  of token ids on the development machine);
* a body above ``LARGE_BODY_BYTES`` is decoded only when it holds the parser's one slot, and
  it yields once before decoding, so every task already ready (a benign request, a stream's
  next event) runs before it: ten large bodies arriving together cost a benign request one
  decode, not ten;
* a front queues at most ``QUEUE_BYTES`` of large bodies waiting to be decoded; past that, or
  after ``WAIT_S`` in the queue, a request gets 503 with ``Retry-After``, its body dropped.

Small bodies (nearly all requests) are decoded at once.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec

from scheduler_svc.front.api_errors import ApiError
from scheduler_svc.front.http.openai_types import decode
from scheduler_svc.front.input.offload import trim_soon

LARGE_BODY_BYTES = 256 << 10
QUEUE_BYTES = 16 << 20  # ~80 ms of decoding at 200 MB/s
WAIT_S = 2.0
RETRY_AFTER_S = 1


class BodyParser:
    def __init__(self, large_bytes: int = LARGE_BODY_BYTES, queue_bytes: int = QUEUE_BYTES,
                 wait_s: float = WAIT_S) -> None:
        self.large_bytes, self.queue_bytes, self.wait_s = large_bytes, queue_bytes, wait_s
        self._slot = asyncio.Lock()  # FIFO: waiters are woken in arrival order
        self.queued = 0  # bytes of large bodies waiting or being decoded
        self.decoded_large = 0  # (tests and metrics)

    async def decode(self, body: bytes, kind: type[msgspec.Struct]) -> Any:
        """``body`` as ``kind`` (openai_types.decode: its 400s), large ones one at a time."""
        if len(body) <= self.large_bytes:
            return decode(body, kind)
        if self.queued + len(body) > self.queue_bytes:
            raise _busy(f"{self.queued} bytes of large request bodies are already waiting to be decoded")
        self.queued += len(body)
        try:
            try:
                await asyncio.wait_for(self._slot.acquire(), self.wait_s)
            except (TimeoutError, asyncio.TimeoutError):
                raise _busy(f"a large request body waited over {self.wait_s:g}s to be decoded") from None
            try:
                await asyncio.sleep(0)  # the tasks already ready run first
                self.decoded_large += 1
                return decode(body, kind)
            finally:
                self._slot.release()
                trim_soon()  # a large decode's garbage (a refused one's, or the body's) back to the OS
        finally:
            self.queued -= len(body)


def _busy(why: str) -> ApiError:
    return ApiError(503, f"the server is decoding other large requests ({why}); retry shortly",
                    code="server_busy", headers={"retry-after": str(RETRY_AFTER_S)})
