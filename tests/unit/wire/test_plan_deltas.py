"""The one walk over a plan's deltas (pagedserve/wire/plan_deltas.py): the documented order, the
rules it holds for every applier, and what it leaves to each."""

from __future__ import annotations

import pytest

from pagedserve.wire import BatchPlan, BlockUpdate, Fork, NewSeq, SamplingParams, pack_ids
from pagedserve.wire.plan_deltas import DeltaError, DeltaTarget, apply_deltas


class _Recorder(DeltaTarget[list]):
    """Each sequence's state is the list of deltas applied to it; every call is logged in order."""

    def __init__(self) -> None:
        self.log: list[tuple] = []

    def new_seq(self, seq):
        self.log.append(("new", seq.seq_id))
        return [("new", seq.seq_id)]

    def fork(self, parent, fork):
        self.log.append(("fork", fork.child_seq_id))
        return [*parent, ("fork", fork.child_seq_id)]

    def append_token(self, state, seq_id, token):
        self.log.append(("append", seq_id, token))
        return [*state, ("append", token)]

    def update_blocks(self, state, update):
        self.log.append(("blocks", update.seq_id))
        return [*state, ("blocks", update.start, tuple(update.block_ids))]

    def free_unknown(self, seq_id):
        self.log.append(("free_unknown", seq_id))

    def swap_out(self, pairs):
        self.log.append(("swap_out", tuple(pairs)))

    def swap_in(self, pairs):
        self.log.append(("swap_in", tuple(pairs)))

    def copy_blocks(self, pairs):
        self.log.append(("copies", tuple(pairs)))


def _new(sid: int) -> NewSeq:
    return NewSeq(sid, pack_ids([5, 6]), 2, [0], 0, SamplingParams())


def test_deltas_apply_in_the_documented_order_whatever_the_plan_lists_first():
    seqs = {1: ["old 1"], 2: ["old 2"]}
    target = _Recorder()
    plan = BatchPlan(0, copies=[(3, 4)], swap_in=[(1, 5)], block_updates=[BlockUpdate(3, 1, [7])],
                     append_tokens=[(3, 9)], forks=[Fork(1, 3)], new_seqs=[_new(2)], free_seq_ids=[2, 8],
                     swap_out=[(6, 2)])
    apply_deltas(plan, seqs, target)
    assert target.log == [("swap_out", ((6, 2),)), ("free_unknown", 8), ("new", 2), ("fork", 3),
                          ("append", 3, 9), ("blocks", 3), ("swap_in", ((1, 5),)), ("copies", ((3, 4),))]
    # seq 2 was freed before it was registered again; seq 3 forked from 1, then extended.
    assert seqs == {1: ["old 1"], 2: [("new", 2)],
                    3: ["old 1", ("fork", 3), ("append", 9), ("blocks", 1, (7,))]}


@pytest.mark.parametrize("plan, message, seq_id", [
    (BatchPlan(0, new_seqs=[_new(1)]), "new_seqs: seq 1 already exists", 1),
    (BatchPlan(0, forks=[Fork(7, 8)]), "fork: unknown parent seq 7", 8),
    (BatchPlan(0, forks=[Fork(1, 1)]), "fork: child seq 1 already exists", 1),
    (BatchPlan(0, append_tokens=[(7, 3)]), "append_tokens: unknown seq 7", 7),
    (BatchPlan(0, block_updates=[BlockUpdate(7, 0, [1])]), "block_updates: unknown seq 7", 7),
    (BatchPlan(0, free_seq_ids=[1], append_tokens=[(1, 3)]), "append_tokens: unknown seq 1", 1),  # freed first
])
def test_every_applier_refuses_a_delta_naming_an_unknown_or_live_sequence(plan, message, seq_id):
    with pytest.raises(DeltaError, match=message) as err:
        apply_deltas(plan, {1: ["old 1"]}, _Recorder())
    assert err.value.seq_id == seq_id


def test_a_free_of_an_unknown_sequence_is_the_targets_to_judge():
    seqs: dict[int, list] = {}
    apply_deltas(BatchPlan(0, free_seq_ids=[4]), seqs, DeltaTarget())  # the default: allowed, nothing moves
    assert seqs == {}
