"""Check a BatchPlan against the executor's sequence state before applying any of it.

Check-then-commit: a plan that names an unknown sequence, a block outside the
pools, or more tokens than a sequence holds is refused as a whole
(:class:`PlanError`) and the runner's state is left untouched. The check is a
dry run of the runner's own walk over the plan's deltas
(``pagedserve/wire/plan_deltas.py``, the order ``messages.py`` documents) on a
shadow of each sequence's (token count, table length, computed count), whose
target checks every id a delta names.

Leniency, on purpose: ``free_seq_ids`` may name sequences we do not know (after
a reconnect the executor has dropped everything the scheduler may still free).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pagedserve.wire import BatchPlan, WireError
from pagedserve.wire.messages import BlockUpdate, Fork, NewSeq
from pagedserve.wire.plan_deltas import DeltaError, DeltaTarget, Pairs, apply_deltas

# A plan that cannot be applied to this executor's state; ``seq_id``: the sequence at fault, when
# one is. One error for every rule a plan breaks, the shared walk's and this check's.
PlanError = DeltaError
Shadow = tuple[int, int, int]  # (num_tokens, table_len, num_computed)


class PlanChecker:
    def __init__(self, num_blocks: int, num_cpu_blocks: int, block_size: int, vocab_size: int,
                 max_model_len: int) -> None:
        self.num_blocks, self.num_cpu_blocks = num_blocks, num_cpu_blocks
        self.block_size, self.vocab_size, self.max_model_len = block_size, vocab_size, max_model_len

    def _blocks(self, ids: Iterable[int], limit: int, what: str, seq_id: int | None = None) -> None:
        if isinstance(ids, list) and (not ids or 0 <= min(ids) and max(ids) < limit):
            return  # (min and max at C speed: a block table can hold 8K ids)
        for b in ids:
            if not 0 <= b < limit:
                raise PlanError(f"{what}: block id {b} out of range [0, {limit})", seq_id)

    def _pairs(self, pairs: list[tuple[int, int]], src_limit: int, dst_limit: int, what: str) -> None:
        self._blocks((p[0] for p in pairs), src_limit, f"{what} source")
        self._blocks((p[1] for p in pairs), dst_limit, f"{what} destination")

    def _tokens(self, ids: Iterable[int], what: str, seq_id: int | None = None) -> None:
        for t in ids:
            if not 0 <= t < self.vocab_size:
                raise PlanError(f"{what}: token id {t} out of range [0, {self.vocab_size})", seq_id)

    def _packed_tokens(self, packed: bytes, what: str, seq_id: int) -> None:
        ids = np.frombuffer(packed, dtype="<u4")  # (a view: one vectorised pass, no int objects)
        bad = np.flatnonzero(ids >= self.vocab_size)
        if bad.size:
            raise PlanError(f"{what}: token id {int(ids[bad[0]])} out of range [0, {self.vocab_size})", seq_id)

    def check(self, plan: BatchPlan, state: dict[int, tuple[int, int, int]], max_decode_steps: int = 1) -> None:
        """state: seq_id -> (num_tokens, table_len, num_computed); raises PlanError. ``max_decode_steps``:
        the most ``plan.decode_steps`` this executor serves."""
        if plan.decode_steps > 1:
            self._multi_step(plan, max_decode_steps)
        shadow = dict(state)
        apply_deltas(plan, shadow, _Shadow(self))  # the runner's own walk, over the shadow
        self._scheduled(plan, shadow)
        if plan.proposals:
            self._proposals(plan, shadow)

    def _proposals(self, plan: BatchPlan, shadow) -> None:
        """Proposals only for sequences this plan decodes (one new token, the last), once each, in
        the vocabulary, their slots in the table and within the model's length; never with
        several decode steps."""
        if plan.decode_steps > 1:
            raise PlanError(f"proposals: a plan of {plan.decode_steps} decode steps does not speculate")
        new = dict(zip(plan.scheduled_seq_ids, plan.num_new_tokens, strict=True))
        seen: set[int] = set()
        for prop in plan.proposals:
            sid = prop.seq_id
            if sid in seen:
                raise PlanError(f"proposals: seq {sid} has two", sid)
            seen.add(sid)
            n, t, c = shadow.get(sid, (0, 0, 0))
            if new.get(sid) != 1 or c + 1 != n:
                raise PlanError(f"proposals: seq {sid} is not decoding in this plan", sid)
            self._tokens(prop.token_ids, f"proposals seq {sid}", sid)
            end = n + len(prop.token_ids)
            if end > t * self.block_size or end > self.max_model_len:
                raise PlanError(f"proposals: seq {sid} reaches {end} tokens, its {t} blocks of {self.block_size} "
                                f"or max_model_len {self.max_model_len} hold fewer", sid)

    def _multi_step(self, plan: BatchPlan, max_decode_steps: int) -> None:
        """A plan of several decode steps only decodes: no sequence arrives, forks, swaps or copies."""
        if plan.decode_steps > max_decode_steps:
            raise PlanError(f"decode_steps {plan.decode_steps}: this executor serves at most {max_decode_steps}")
        if plan.new_seqs or plan.forks or plan.append_tokens or plan.swap_out or plan.swap_in or plan.copies:
            raise PlanError(f"decode_steps {plan.decode_steps}: a plan of several decode steps has only "
                            "scheduled decodes, frees and block updates")

    def check_decoders(self, plan: BatchPlan, seqs: dict) -> None:
        """After :meth:`check` passed a plan of several decode steps: PlanError unless every sequence it
        schedules (``seqs``: seq_id -> the runner's SeqState) samples plainly: no beam candidates,
        log-probs, grammar or prompt scores, whose results have one step's layout."""
        for sid in plan.scheduled_seq_ids:
            sp = seqs[sid].sampling
            if sp.beam_candidates or sp.want_logprobs or sp.structured is not None or sp.prompt_logprobs >= 0:
                raise PlanError(f"scheduled seq {sid}: beam search, log-probs, structured outputs and prompt "
                                f"scores take one decode step per plan, the plan has {plan.decode_steps}", sid)

    def check_proposers(self, plan: BatchPlan, seqs: dict) -> None:
        """After :meth:`check` passed a plan with proposals: PlanError unless each proposing sequence
        (``seqs``: seq_id -> the runner's SeqState, new ones included) is verified by the plain
        sampler: no beam candidates (a constrained one is verified under its grammar)."""
        arriving = {n.seq_id: n.sampling for n in plan.new_seqs}
        for prop in plan.proposals:
            s = seqs.get(prop.seq_id)
            sp = s.sampling if s is not None else arriving.get(prop.seq_id)
            if sp is not None and sp.beam_candidates:
                raise PlanError(f"proposals: seq {prop.seq_id} has beam candidates, which speculative decoding "
                                "does not verify", prop.seq_id)

    def _scheduled(self, plan: BatchPlan, shadow) -> None:
        if len(set(plan.scheduled_seq_ids)) != len(plan.scheduled_seq_ids):
            raise PlanError("scheduled_seq_ids: a sequence is scheduled twice")
        steps = plan.decode_steps
        for sid, k in zip(plan.scheduled_seq_ids, plan.num_new_tokens, strict=True):
            if (known := shadow.get(sid)) is None:
                raise PlanError(f"scheduled_seq_ids: unknown seq {sid}", sid)
            n, t, c = known
            if k < 1 or c + k > n:
                raise PlanError(f"scheduled seq {sid}: {k} new tokens with {c} computed of {n}", sid)
            if steps > 1 and (k != 1 or c + 1 != n):
                raise PlanError(f"scheduled seq {sid}: {k} new tokens with {c} computed of {n} is not a decode "
                                f"step, and the plan has {steps}", sid)
            end = c + k + steps - 1  # (the positions the later decode steps write)
            if end > t * self.block_size:
                raise PlanError(f"scheduled seq {sid}: {end} tokens do not fit in {t} blocks "
                                f"of {self.block_size}", sid)
            if steps > 1 and end > self.max_model_len:
                raise PlanError(f"scheduled seq {sid}: {steps} decode steps reach {end} tokens, more than "
                                f"{self.max_model_len}", sid)


class _Shadow(DeltaTarget[Shadow]):
    """The plan's deltas on the shadow state, each id they name checked against the pools and the
    vocabulary; no block moves."""

    def __init__(self, checker: PlanChecker) -> None:
        self.c = checker

    def swap_out(self, pairs: Pairs) -> None:
        self.c._pairs(pairs, self.c.num_blocks, self.c.num_cpu_blocks, "swap_out")

    def swap_in(self, pairs: Pairs) -> None:
        self.c._pairs(pairs, self.c.num_cpu_blocks, self.c.num_blocks, "swap_in")

    def copy_blocks(self, pairs: Pairs) -> None:
        self.c._pairs(pairs, self.c.num_blocks, self.c.num_blocks, "copies")

    def fork(self, parent: Shadow, fork: Fork) -> Shadow:
        return parent

    def append_token(self, state: Shadow, seq_id: int, token: int) -> Shadow:
        self.c._tokens([token], f"append_tokens seq {seq_id}", seq_id)
        n, t, c = state
        return n + 1, t, c

    def update_blocks(self, state: Shadow, u: BlockUpdate) -> Shadow:
        n, t, c = state
        if not 0 <= u.start <= t:
            raise PlanError(f"block_updates seq {u.seq_id}: start {u.start} outside [0, {t}]", u.seq_id)
        self.c._blocks(u.block_ids, self.c.num_blocks, f"block_updates seq {u.seq_id}", u.seq_id)
        return n, u.start + len(u.block_ids), c

    def new_seq(self, s: NewSeq) -> Shadow:
        c = self.c
        try:
            n = s.num_tokens  # (the packing's own rule: whole uint32s)
        except WireError as exc:
            raise PlanError(f"new_seqs seq {s.seq_id}: {exc}", s.seq_id) from None
        if n == 0 or n > c.max_model_len:
            raise PlanError(f"new_seqs seq {s.seq_id}: {n} tokens, expected 1..{c.max_model_len}", s.seq_id)
        if not 0 <= s.num_prompt_tokens <= n:
            raise PlanError(f"new_seqs seq {s.seq_id}: num_prompt_tokens {s.num_prompt_tokens} outside [0, {n}]", s.seq_id)
        if not 0 <= s.num_computed_tokens <= n:
            raise PlanError(f"new_seqs seq {s.seq_id}: num_computed_tokens {s.num_computed_tokens} "
                            f"outside [0, {n}]", s.seq_id)
        if s.num_computed_tokens > len(s.block_ids) * c.block_size:
            raise PlanError(f"new_seqs seq {s.seq_id}: {s.num_computed_tokens} computed tokens do not fit "
                            f"in {len(s.block_ids)} blocks", s.seq_id)
        c._packed_tokens(s.token_ids, f"new_seqs seq {s.seq_id}", s.seq_id)
        c._blocks(s.block_ids, c.num_blocks, f"new_seqs seq {s.seq_id}", s.seq_id)
        if s.sampling.beam_candidates < 0 or s.sampling.logprobs < 0 or s.sampling.top_k < 0:
            raise PlanError(f"new_seqs seq {s.seq_id}: negative beam_candidates, logprobs or top_k", s.seq_id)
        return n, len(s.block_ids), s.num_computed_tokens
