"""Where a new request goes: which executor's scheduler gets it.

For now: the ready executor with the most free KV blocks after subtracting
what its not-yet-admitted requests will need. (Prefix-cache-aware routing
builds on this cost; see docs/ARCHITECTURE.md.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from scheduler_svc.engine import ExecutorSlot


def choose_executor(slots: list[ExecutorSlot], prompt_token_ids: list[int]) -> ExecutorSlot | None:
    ready = [s for s in slots if s.conn.state == "ready"]
    if not ready:
        return None

    def headroom(s: ExecutorSlot) -> float:
        block = s.scheduler.config.block_size
        pending_blocks = sum(-(-len(t.stream.req.prompt_token_ids) // block) for t in s.adds)
        return s.scheduler.num_free_blocks - pending_blocks

    return max(ready, key=headroom)
