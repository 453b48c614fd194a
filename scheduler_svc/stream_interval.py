"""The fronts' ``--stream-interval``: several of a request's outputs sent as one message.

Each streamed message costs the front a write: for gRPC ~20 us of the scheduler's CPU
per message, several times the engine's own work per token (docs/PERF.md, "Streaming
cost of the fronts"). Holding a request's tokens for a few steps trades streaming
granularity for fewer writes, as SGLang's option of the same name does. The default,
1, streams every step's tokens at once.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from scheduler_svc.api_types import RequestOutput
from scheduler_svc.outputs import merge_outputs


async def coalesce(stream: AsyncIterator[RequestOutput], interval: int) -> AsyncIterator[RequestOutput]:
    """``stream`` with its outputs merged, for the fronts' ``--stream-interval``.

    The first output goes out at once (time to first token is unchanged); after it, outputs are
    held until one choice has ``interval`` new tokens, or the request finishes. Each message
    then costs the front one write for several tokens (a gRPC write is ~20 us of the scheduler's
    CPU, docs/PERF.md). An error first releases what is held, so no generated token is lost.
    Closing this closes ``stream``.
    """
    async with contextlib.aclosing(stream):  # type: ignore[type-var]
        held: list[RequestOutput] = []
        counts: dict[int, int] = {}
        first = True
        try:
            async for out in stream:
                if first or out.finished:
                    first = False
                    held.append(out)
                    yield merge_outputs(held)
                    held, counts = [], {}
                    continue
                held.append(out)
                for c in out.choices:
                    counts[c.index] = counts.get(c.index, 0) + len(c.token_ids)
                if max(counts.values(), default=0) >= interval:
                    yield merge_outputs(held)
                    held, counts = [], {}
        except Exception:
            if held:
                yield merge_outputs(held)
            raise

