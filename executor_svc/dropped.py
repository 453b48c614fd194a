"""Sequences the executor dropped after a step failed, and the plans that still name them.

When a step cannot serve some sequences (a forward or sampler error), the executor
drops their state and reports them in ``StepResult.failed_seq_ids``; the scheduler
fails the requests that own them. Plans it sent before it learned of the failure may
still name them. The contract (``pagedserve/wire/messages.py``, ``StepResult``) is that
the executor skips every entry naming a dropped sequence, that a fork from one drops
its child too, and that a plan freeing one ends the matter; the scheduler computes the
same closure (``InFlight.forget``), so both agree on what those plans serve without a
message more.
"""

from __future__ import annotations

import msgspec

from pagedserve.wire import BatchPlan


class DroppedSeqs:
    def __init__(self) -> None:
        self.ids: set[int] = set()

    def __bool__(self) -> bool:
        return bool(self.ids)

    def add(self, seq_ids) -> None:
        self.ids.update(seq_ids)

    def clear(self) -> None:
        self.ids.clear()

    def skip(self, plan: BatchPlan) -> BatchPlan:
        """``plan`` without what names a dropped sequence (the same plan when nothing does). A fork
        from a dropped parent drops its child; a free of a dropped sequence forgets it here."""
        ids = self.ids
        if not ids:
            return plan
        freed = [sid for sid in plan.free_seq_ids if sid in ids]  # forgotten here already
        ids.difference_update(freed)
        forks = []
        for f in plan.forks:
            if f.parent_seq_id in ids:
                ids.add(f.child_seq_id)
            else:
                forks.append(f)
        scheduled, num_new = _rows_kept(plan, ids)
        return msgspec.structs.replace(
            plan, scheduled_seq_ids=scheduled, num_new_tokens=num_new,
            free_seq_ids=[sid for sid in plan.free_seq_ids if sid not in freed] if freed else plan.free_seq_ids,
            forks=forks, append_tokens=[(sid, t) for sid, t in plan.append_tokens if sid not in ids],
            block_updates=[u for u in plan.block_updates if u.seq_id not in ids],
            new_seqs=[s for s in plan.new_seqs if s.seq_id not in ids],
            proposals=[p for p in plan.proposals if p.seq_id not in ids],
            draft_proposals=[d for d in plan.draft_proposals if d.seq_id not in ids])

    def unscheduled(self, plan: BatchPlan) -> BatchPlan | None:
        """``plan`` (already applied) without the rows and proposals of dropped sequences; None when
        it schedules none of them."""
        ids = self.ids
        if not any(sid in ids for sid in plan.scheduled_seq_ids):
            return None
        scheduled, num_new = _rows_kept(plan, ids)
        return msgspec.structs.replace(plan, scheduled_seq_ids=scheduled, num_new_tokens=num_new,
                                       proposals=[p for p in plan.proposals if p.seq_id not in ids])

    def fork_closure(self, plan: BatchPlan) -> set[int]:
        """The children ``plan`` (already applied) forked from dropped sequences: dropped now too."""
        children = set()
        for f in plan.forks:
            if f.parent_seq_id in self.ids or f.parent_seq_id in children:
                children.add(f.child_seq_id)
        self.ids |= children
        return children


def _rows_kept(plan: BatchPlan, ids: set[int]) -> tuple[list[int], list[int]]:
    """The plan's scheduled sequences and their new-token counts, those in ``ids`` left out."""
    kept = [(sid, n) for sid, n in zip(plan.scheduled_seq_ids, plan.num_new_tokens, strict=True) if sid not in ids]
    return [sid for sid, _ in kept], [n for _, n in kept]
