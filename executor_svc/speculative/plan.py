"""A plan's proposals on the runner's sequences: n-gram proposals (the scheduler's tokens) and a
draft model's (placeholders the draft fills at launch), made one path for checking, applying,
dropping, batching and verifying.
"""

from __future__ import annotations

import msgspec

from executor_svc.batch import Batch, SeqState
from executor_svc.plan_check import PlanError
from executor_svc.speculative.draft import DraftModel
from pagedserve.wire import BatchPlan, Proposal


def with_draft_placeholders(plan: BatchPlan, draft: DraftModel | None) -> BatchPlan:
    """``plan`` whose ``draft_proposals`` are proposals too, of placeholder tokens (0) the draft
    replaces at launch (:func:`draft_into`); PlanError when this executor cannot draft them."""
    if draft is None:
        raise PlanError("draft_proposals: this executor holds no draft model (--speculative-model)")
    if {d.seq_id for d in plan.draft_proposals} & {p.seq_id for p in plan.proposals}:
        raise PlanError("draft_proposals: a sequence has both proposals and draft proposals")
    return msgspec.structs.replace(plan, proposals=[
        *plan.proposals, *(Proposal(d.seq_id, [0] * d.num_tokens) for d in plan.draft_proposals)])


def append_proposals(plan: BatchPlan, seqs: dict[int, SeqState]) -> None:
    """Each proposing sequence's proposals appended to its tokens for this step's forward
    (verification takes back what it rejects); a draft's are marked to be drafted."""
    drafted = {d.seq_id for d in plan.draft_proposals}
    for prop in plan.proposals:
        s = seqs[prop.seq_id]
        s.proposals = list(prop.token_ids)
        s.drafted = prop.seq_id in drafted
        s.token_ids.extend(s.proposals)


def draft_into(draft: DraftModel, batch: Batch) -> None:
    """The draft's proposals of the batch's drafting sequences, into their tokens and the batch's
    input rows (after the row of each one's last committed token)."""
    todo = [(s, len(props)) for s, props, _ in batch.spec if s.drafted]
    if not todo:
        return
    draft.propose(todo)
    for s, props, row in batch.spec:
        if s.drafted:
            batch.token_ids[row + 1:row + 1 + len(props)] = props
