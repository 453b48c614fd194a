"""A request's outputs as its consumer reads them: what ``Engine.generate`` returns.

The fan-out hands each output to the request's :class:`~scheduler_svc.front.output.mailbox.Tracked`;
this is the other end, the consumer's. Every ``__anext__`` returns a future, and
when the consumer already waits the fan-out completes that future with the
output itself: a token reaches its consumer with one future and one task
wake-up. It was an async generator (awaiting a wake-up future, then taking the
output from the mailbox), which resumed one more frame twice per token: 1.05 vs
0.72 us per token with 256 consumers (docs/PERF.md, "Asynchronous scheduling").

Outputs put while the consumer was busy elsewhere (a slow client holds its writes back)
are handed over merged, as one output, as vLLM's per-request output collector does: a
consumer that fell behind catches up with one message, not one per step.

It keeps an async generator's contract:

- the request is admitted at the first ``__anext__`` (an ``EngineError`` such as
  QUEUE_FULL is raised by awaiting it), not when the stream is made;
- an error ends the stream (the awaited future raises it), as does the finished output;
- stopping early aborts the request and frees its blocks: ``aclose()``, dropping
  the stream unclosed, or cancelling its consumer while it waits for an output
  (the stream then ends; the abort comes with ``aclose()``, the drop, or the next
  ``__anext__``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from pagedserve.engine_api import GenerationRequest, RequestOutput
from scheduler_svc.front.output.deltas import merge_outputs
from scheduler_svc.front.output.mailbox import Tracked


class OutputStream:
    """An async iterator of one request's :class:`RequestOutput` messages, oldest first."""

    __slots__ = ("_req", "_admit", "_abandon", "_tracked", "_loop", "_last", "_closed")

    def __init__(self, req: GenerationRequest, admit: Callable[[GenerationRequest], Tracked],
                 abandon: Callable[[Tracked], None]) -> None:
        self._req = req
        self._admit = admit  # the engine's admission: a Tracked, or raises why not
        self._abandon = abandon  # aborts the request if it is still running
        self._tracked: Tracked | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._last: asyncio.Future | None = None  # the future the last __anext__ returned
        self._closed = False  # ended or closed: only StopAsyncIteration from here on

    def __aiter__(self) -> OutputStream:
        return self

    def __anext__(self) -> asyncio.Future[RequestOutput]:
        # Always a future, never a synchronous raise: anext(stream, default) crashes CPython
        # 3.11 when __anext__ raises StopAsyncIteration itself.
        t = self._tracked
        if t is None:
            return self._first()
        last = self._last
        if last is not None and not last.done():
            return self._failed(RuntimeError("anext(): the previous output is still awaited"))
        if self._closed or last is not None and last.cancelled():
            return self._stop()  # (a consumer cancelled while waiting ended the stream)
        if t.outbox:  # outputs that came while nobody waited: all of them, as one
            return self._deliver(self._backlog(t.outbox))
        if t.ended:
            return self._stop()
        f = self._last = t.waiter = self._loop.create_future()  # type: ignore[union-attr]
        return f

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """End the stream; a request still running is aborted and its blocks freed."""
        if self._closed:
            return
        self._closed = True
        last, t = self._last, self._tracked
        if last is not None and not last.done():  # closed while a consumer waits: its stream ends
            last.set_exception(StopAsyncIteration())
            last.exception()  # (retrieved: an end unawaited is not an error for asyncio to log)
        if t is not None:
            if t.waiter is last:
                t.waiter = None
            self._abandon(t)

    def __del__(self) -> None:
        # Dropped unclosed (its consumer went away): abort on the loop, as an async generator's
        # finalizer would. The collector may run this on any thread.
        if not self._closed and self._tracked is not None and self._loop is not None:
            try:
                self._loop.call_soon_threadsafe(self.close)
            except RuntimeError:  # the loop is closed: so is the engine
                pass

    def _first(self) -> asyncio.Future[RequestOutput]:
        if self._closed:
            return self._stop()
        self._loop = asyncio.get_running_loop()
        try:
            self._tracked = self._admit(self._req)
        except Exception as exc:  # noqa: BLE001  not admitted: awaiting the first output raises why
            self._closed = True
            return self._failed(exc)
        return self.__anext__()

    @staticmethod
    def _backlog(outbox: list) -> RequestOutput | Exception:
        """The outputs waiting at the head of ``outbox`` merged into one (taken out of it), or
        the error at its head. A consumer that fell behind (a slow client holding its writes
        back) catches up with one message instead of one per step."""
        n = 0
        while n < len(outbox) and not isinstance(outbox[n], Exception):
            n += 1
        if n <= 1:  # the error, or one output: nothing to merge
            return outbox.pop(0)
        outs = outbox[:n]
        del outbox[:n]
        return merge_outputs(outs)

    def _deliver(self, item: RequestOutput | Exception) -> asyncio.Future[RequestOutput]:
        if isinstance(item, Exception):
            self._closed = True
            return self._failed(item)
        f = self._last = self._loop.create_future()  # type: ignore[union-attr]
        f.set_result(item)
        return f

    def _failed(self, exc: BaseException) -> asyncio.Future[RequestOutput]:
        f = (self._loop or asyncio.get_running_loop()).create_future()
        f.set_exception(exc)
        return f

    def _stop(self) -> asyncio.Future[RequestOutput]:
        self.close()
        return self._failed(StopAsyncIteration())
