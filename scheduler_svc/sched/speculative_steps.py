"""Speculative decoding in the scheduler's steps: which decoding sequence proposes, and what its
result does to it (the plan side is a few lines in ``scheduler.py``).

A sequence proposes when its last token is known (no sample of it in flight: with asynchronous
scheduling a proposing sequence skips the plan after its own, since how many tokens it gets is
unknown until the result), it decodes as one sequence (no beams, not one of n; a constrained one
is verified under its grammar),
the policy lets it (``speculation_policy.py``) and the n-gram lookup finds something, never more
than fit before its length limit. Its plan decodes its last token as usual and carries the
proposals; its table and the step's token budget hold their slots.

The result's first token per sequence is applied as any sample (``step_output.py``); the tokens
after it (``StepResult.spec_tokens``) here, each through the same end checks (EOS, stop token
ids, length), so no token past an end is ever reported. Then the sequence's computed count
covers the verified tokens only, the blocks past them go back to the pool, and the blocks full
of verified tokens go to the prefix cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.engine_api import EngineStats, RequestUpdate
from pagedserve.wire import BatchPlan, DraftProposal, Proposal, StepResult
from scheduler_svc.sched.in_flight import ProtocolError
from scheduler_svc.sched.speculation import DraftProposer, NgramProposer, SpeculativeConfig, TokenMirror
from scheduler_svc.sched.speculation_policy import SpeculationPolicy
from scheduler_svc.sched.step_output import end_reason, token_logprob

if TYPE_CHECKING:
    from scheduler_svc.sched.in_flight import InFlight
    from scheduler_svc.sched.request import Request, Sequence
    from scheduler_svc.sched.step_output import OutputProcessor


@dataclass(slots=True)
class SpecCounters:
    """vLLM's spec_decode counters: proposal rounds, tokens proposed, accepted, accepted by position."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def count(self, proposed: int, accepted: int) -> None:
        self.add(SpecCounters(1, proposed, accepted, [1] * accepted))

    def add(self, other: SpecCounters) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        per_pos = self.accepted_per_pos
        per_pos.extend([0] * (len(other.accepted_per_pos) - len(per_pos)))
        for i, n in enumerate(other.accepted_per_pos):
            per_pos[i] += n

    def report(self, stats: EngineStats) -> None:
        stats.spec_num_drafts, stats.spec_num_draft_tokens = self.num_drafts, self.num_draft_tokens
        stats.spec_num_accepted_tokens, stats.spec_accepted_per_pos = self.num_accepted_tokens, list(self.accepted_per_pos)


class SpeculativeSteps:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.draft = config.model is not None  # proposals made by the executor's draft model
        self.proposer = DraftProposer(config) if self.draft else NgramProposer(config)
        self.policy = SpeculationPolicy(config.num_speculative_tokens, max_verified_tokens=config.max_verified_tokens)
        self.mirror = TokenMirror()  # (the n-gram lookup's view of the tokens)
        self.pending: set[int] = set()  # seq ids whose proposals' result is in flight
        self.counters = SpecCounters()  # (telemetry reads them, summed over the engine's schedulers)

    def put(self, plan: BatchPlan, seq_id: int, props: list[int]) -> None:
        """``props`` (from :meth:`propose`) into the plan: the tokens, or the draft's count."""
        if self.draft:
            plan.draft_proposals.append(DraftProposal(seq_id, len(props)))
        else:
            plan.proposals.append(Proposal(seq_id, props))

    def proposal_room(self, num_running: int) -> int:
        """Proposed tokens this step may carry in all (the policy's per-step budget)."""
        return self.policy.proposal_room(num_running)

    def waits(self, r: Request, seq: Sequence) -> bool:
        """Whether a sequence whose last token is still in flight (asynchronous scheduling) should wait
        for it instead of decoding it blind: when it would propose, which needs that token, and its
        known tokens already end in a repeated n-gram (else it pipelines as usual)."""
        if self._excluded(r, seq) or seq.num_placeholders > 1:
            return False
        if not self.policy.may_propose(seq.seq_id):
            return False
        return bool(self.proposer.propose(self._tokens(seq), 1))

    def propose(self, r: Request, seq: Sequence, total: int, room_tokens: int) -> list[int]:
        """Proposals for ``seq`` (its ``total`` tokens all known, the last one to decode now), at most
        ``room_tokens`` of them (the step's token budget left after its own token)."""
        if self._excluded(r, seq):
            return []
        room = min(self.proposer.k, r.stop_len - total - 1, room_tokens)
        if room <= 0 or not self.policy.wants_proposals(seq.seq_id):
            return []
        return self.proposer.propose(self._tokens(seq), room)

    def _tokens(self, seq: Sequence):
        """What the proposer reads: the n-gram lookup the mirror, any other (the draft's placeholders,
        a test's oracle) the list."""
        if not isinstance(self.proposer, NgramProposer):
            return seq.token_ids
        return self.mirror.view(seq.seq_id, seq.token_ids)

    def forget(self, seq_id: int) -> None:
        """The sequence ended (however: a step, an abort, a stop string): drop what was kept of it."""
        self.policy.forget(seq_id)
        self.mirror.forget(seq_id)

    def _excluded(self, r: Request, seq: Sequence) -> bool:
        """Decodes without speculation: beams and n > 1 (their forks share blocks a rollback would
        have to unshare)."""
        return seq.sampling.beam_candidates > 0 or r.req.params.n > 1

    def check(self, result: StepResult, step: InFlight, failed: set[int], out: OutputProcessor) -> None:
        """ProtocolError unless the result's extra tokens answer the plan's proposals."""
        vocab = out.vocab_size
        proposed = {s.seq_id: (s, d) for s, d in step.proposed}
        seen: set[int] = set()
        for x in result.spec_tokens:
            if x.seq_id not in proposed or x.seq_id in failed or x.seq_id in seen:
                raise ProtocolError(f"result {result.step_id} has speculative tokens for seq {x.seq_id}, "
                                    "which its plan gave no proposals (or gave them once)")
            seen.add(x.seq_id)
            seq, d = proposed[x.seq_id]
            if len(x.token_ids) > d:
                raise ProtocolError(f"result {result.step_id} emits {len(x.token_ids) + 1} tokens for seq {x.seq_id} "
                                    f"from {d} proposals")
            if vocab is not None and x.token_ids and max(x.token_ids) >= vocab:
                raise ProtocolError(f"result {result.step_id} has token id {max(x.token_ids)} outside the vocabulary")
            want = len(x.token_ids) if seq.sampling.want_logprobs else 0
            if len(x.logprobs) != want:
                raise ProtocolError(f"result {result.step_id} has {len(x.logprobs)} log-probs for the {len(x.token_ids)} "
                                    f"speculative tokens of seq {x.seq_id}")
            for lp in x.logprobs:
                if lp.seq_id != x.seq_id:
                    raise ProtocolError(f"result {result.step_id} has log-probs of seq {lp.seq_id} among seq {x.seq_id}'s")
                out.check_top(result.step_id, lp, seq.sampling.logprobs, "log-probs")

    def apply(self, result: StepResult, step: InFlight, updates: list[RequestUpdate], failed: set[int],
              out: OutputProcessor) -> None:
        """After the first tokens were applied: each proposing sequence's further tokens, its computed
        count, blocks and cache entries, the policy and the counters. A sequence whose handling
        raises fails its own request only (``updates`` gains that)."""
        extra = {x.seq_id: x for x in result.spec_tokens}
        by_request = {u.request_id: u for u in updates}
        for seq, d, residency in step.proposed_at:
            self.pending.discard(seq.seq_id)
            if seq.seq_id in failed:
                continue
            try:
                self._apply_seq(seq, d, residency, extra.get(seq.seq_id), by_request, out)
            except Exception as exc:  # noqa: BLE001  one request's failure must not reach the others
                if seq.request.request_id in out.s.requests:
                    updates.append(out.s.fail_request(seq.request, exc))

    def _apply_seq(self, seq: Sequence, d: int, residency: int, x, by_request: dict[str, RequestUpdate],
                   out: OutputProcessor) -> None:
        toks = x.token_ids if x is not None else []
        self.counters.count(d, len(toks))  # every emitted token but the last was an accepted proposal
        self.policy.observe(seq.seq_id, d, len(toks))
        r = seq.request
        r.spec_proposed += d
        r.spec_accepted += len(toks)
        if (ru := by_request.get(r.request_id)) is not None:  # (the usage's totals, on the update of this step)
            ru.spec_proposed_tokens, ru.spec_accepted_tokens = r.spec_proposed, r.spec_accepted
        if seq.finish_reason is None and toks:
            self._append(seq, toks, x.logprobs, by_request.get(seq.request.request_id), out)
        if seq.finish_reason is not None:  # ended (now or by its first token), or aborted: the rest dropped
            self.forget(seq.seq_id)  # (again: observe above re-tracked one finish_seq had forgotten)
        elif seq.resident and seq.residency == residency:
            kv = out.s.kv
            seq.num_computed_tokens = len(seq.token_ids) - 1  # the verified tokens: K/V written and kept
            kv.rollback(seq, len(seq.token_ids))
            kv.commit_computed(seq, seq.num_computed_tokens)

    def _append(self, seq: Sequence, toks: list[int], logprobs, ru: RequestUpdate | None,
                out: OutputProcessor) -> None:
        """``toks`` after the step's first token, into the update that carries that token."""
        r = seq.request
        su = next((u for u in ru.seqs if u.index == seq.index), None) if ru is not None else None
        if su is None:  # the first token's update is made for every sequence still running
            raise RuntimeError(f"seq {seq.seq_id}: no update carries its first token")
        for j, tok in enumerate(toks):
            seq.token_ids.append(tok)
            su.new_token_ids.append(tok)
            if logprobs:
                su.logprobs = [*(su.logprobs or []), *token_logprob(logprobs[j], tok)]
            reason = end_reason(r, seq.token_ids, tok)
            if reason is not None:
                su.finish_reason = reason
                ru.finished = out.finish(seq, reason)
                return
