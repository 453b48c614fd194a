"""A BatchPlan's deltas applied to per-sequence state: the documented order, written once.

``messages.py`` documents the order in which an executor applies a plan (swap out, free, register,
fork, append, block updates, swap in, copy). :func:`apply_deltas` is that order, and everything
that applies a plan goes through it: the executor's runner (its sequence state and KV cache), its
plan check (a dry run over a shadow of that state, so a refused plan applies nothing), the
tests' fake executor and the benchmarks' simulated executor. Each says what a sequence's state
is and what the block moves do (a :class:`DeltaTarget`); the walk and its structural rules are
shared.

The walk's own rules, the same for every target: a fork, an appended token or a block update
naming no live sequence, and a new or forked sequence whose id is live, raise
:class:`DeltaError`. What a free of an unknown sequence means is the target's (the executor
allows it: after a reconnect it knows none of what the scheduler may still free).
"""

from __future__ import annotations

from typing import Generic, TypeVar

from pagedserve.wire.messages import BatchPlan, BlockUpdate, Fork, LoraLoad, NewSeq

S = TypeVar("S")  # a target's per-sequence state
Pairs = list[tuple[int, int]]


class DeltaError(ValueError):
    """A plan that does not fit the state it is applied to; ``seq_id``: the sequence at fault, when
    one is."""

    def __init__(self, message: str, seq_id: int | None = None) -> None:
        super().__init__(message)
        self.seq_id = seq_id


class DeltaTarget(Generic[S]):
    """What differs between appliers. The state methods return the sequence's state after the
    delta (the same object for mutable state; a new value for a shadow of immutable tuples).
    The block moves do nothing here: only a real KV cache, or a simulated one, has blocks."""

    def new_seq(self, seq: NewSeq) -> S:
        raise NotImplementedError

    def fork(self, parent: S, fork: Fork) -> S:
        """The child's state: a copy of ``parent`` (its own token list and block table)."""
        raise NotImplementedError

    def append_token(self, state: S, seq_id: int, token: int) -> S:
        raise NotImplementedError

    def update_blocks(self, state: S, update: BlockUpdate) -> S:
        """``table[update.start:] = update.block_ids``."""
        raise NotImplementedError

    def free_unknown(self, seq_id: int) -> None:
        """A free naming no live sequence: allowed unless a target says otherwise."""

    def swap_out(self, pairs: Pairs) -> None:
        """(device block, CPU block) copies."""

    def load_lora(self, load: LoraLoad) -> None:
        """Load an adapter into a slot (no sequence left uses it): only a target that holds adapters."""

    def swap_in(self, pairs: Pairs) -> None:
        """(CPU block, device block) copies."""

    def copy_blocks(self, pairs: Pairs) -> None:
        """(device block, device block) copies (copy-on-write)."""


def apply_deltas(plan: BatchPlan, seqs: dict[int, S], target: DeltaTarget[S]) -> None:
    """Apply ``plan``'s deltas (steps 1-8 of the order in ``messages.py``) to ``seqs``, in place.
    Its scheduled sequences (step 9) are the caller's. Raises :class:`DeltaError` (or what the
    target raises) at the first delta that does not fit, with the deltas before it applied: a
    caller that must apply all or nothing runs this first over a shadow of its state."""
    target.swap_out(plan.swap_out)
    for sid in plan.free_seq_ids:
        if seqs.pop(sid, None) is None:
            target.free_unknown(sid)
    for load in plan.lora_loads:
        target.load_lora(load)
    for s in plan.new_seqs:
        if s.seq_id in seqs:
            raise DeltaError(f"new_seqs: seq {s.seq_id} already exists", s.seq_id)
        seqs[s.seq_id] = target.new_seq(s)
    for f in plan.forks:
        parent = seqs.get(f.parent_seq_id)
        if parent is None:
            raise DeltaError(f"fork: unknown parent seq {f.parent_seq_id}", f.child_seq_id)
        if f.child_seq_id in seqs:
            raise DeltaError(f"fork: child seq {f.child_seq_id} already exists", f.child_seq_id)
        seqs[f.child_seq_id] = target.fork(parent, f)
    for sid, tok in plan.append_tokens:
        seqs[sid] = target.append_token(_known(seqs, sid, "append_tokens"), sid, tok)
    for u in plan.block_updates:
        seqs[u.seq_id] = target.update_blocks(_known(seqs, u.seq_id, "block_updates"), u)
    target.swap_in(plan.swap_in)
    target.copy_blocks(plan.copies)


def _known(seqs: dict[int, S], seq_id: int, what: str) -> S:
    state = seqs.get(seq_id)
    if state is None:
        raise DeltaError(f"{what}: unknown seq {seq_id}", seq_id)
    return state
