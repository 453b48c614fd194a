"""Turning a StepResult into token appends, stop decisions and RequestUpdates.

Split from scheduler.py so the hot loop over sampled tokens stays readable.
Sampled tokens replace their placeholders (the executor appended them on its
side already); beam requests go through :mod:`scheduler_svc.sched.beam_search`, whose
chosen continuations become forks and ``append_tokens`` owed to the executor.

A result must sample exactly the sequences its plan said would sample, in plan
order (the executor samples every scheduled sequence that reaches its token
count), less those it reports failed, with token ids in the vocabulary;
anything else is the executor breaking the contract (ProtocolError), found
before anything of the result is applied.
Samples of sequences that finished or were aborted after the plan was sent are
dropped: with asynchronous scheduling a finished sequence may be computed once
more, and that token never reaches a client.
"""

from __future__ import annotations

from pagedserve.engine_api import (
    ErrorKind,
    FinishReason,
    PromptScores,
    RequestUpdate,
    SeqUpdate,
    TokenLogprob,
)
from pagedserve.wire import SeqLogprobs, StepResult
from scheduler_svc.sched.beam_search import BeamCandidate, BeamLimits, beam_step, final_hypotheses
from scheduler_svc.sched.in_flight import InFlight, ProtocolError
from scheduler_svc.sched.lifecycle import RequestLifecycle
from scheduler_svc.sched.request import Request, RequestState, Sequence


class OutputProcessor:
    def __init__(self, sched: RequestLifecycle, vocab_size: int | None = None) -> None:
        self.s = sched
        self.vocab_size = vocab_size  # token ids a result may carry: [0, vocab_size) (None: unchecked)

    def check(self, result: StepResult, step: InFlight, failed: set[int]) -> list[Sequence]:
        """ProtocolError unless ``result`` answers ``step`` as the contract says; the sequences it
        samples for, in plan order. It must sample exactly what the plan said would sample, less the
        sequences it failed (``failed``, which the plan must have scheduled), with token ids in the
        vocabulary and no more log-probs or beam candidates than were asked for."""
        rid = result.step_id
        if failed and not failed <= set(step.seq_ids):
            raise ProtocolError(f"result {rid} fails sequences its plan did not schedule")
        due = step.sampling if not failed else [s for s in step.sampling if s.seq_id not in failed]
        sampled, k = result.sampled_seq_ids, step.decode_steps
        if len(sampled) != len(due) * k:
            raise ProtocolError(f"result {rid} samples {len(sampled)} sequences, its plan {len(due)} x {k} steps")
        if k > 1:  # (each step's samples in plan order, one step after another)
            if sampled != [s.seq_id for s in due] * k:
                raise ProtocolError(f"result {rid} does not sample its plan's sequences in plan order, step by step")
        else:
            for seq, sid in zip(due, sampled, strict=True):
                if seq.seq_id != sid:
                    raise ProtocolError(f"result {rid} samples seq {sid} where its plan has {seq.seq_id}")
        vocab = self.vocab_size
        if vocab is not None and result.sampled_token_ids and max(result.sampled_token_ids) >= vocab:
            raise ProtocolError(f"result {rid} samples token id {max(result.sampled_token_ids)}, outside the "
                                f"vocabulary of {vocab}")
        if result.logprobs or any(s.sampling.want_logprobs for s in due):
            self._check_logprobs(result, due)
        beams = [s for s in step.beams if s.seq_id not in failed]
        if [c.seq_id for c in result.beam_candidates] != [s.seq_id for s in beams]:
            raise ProtocolError(f"result {rid} has beam candidates for other sequences than its plan")
        for seq, c in zip(beams, result.beam_candidates, strict=True):
            self.check_top(rid, c, seq.sampling.beam_candidates - 1, "beam candidates")
        if result.prompt_logprobs:
            self._check_prompt_scores(result, step)
        return due

    def _check_prompt_scores(self, result: StepResult, step: InFlight) -> None:
        """Prompt scores only for sequences the plan computed, that asked, within their prompt, with
        as many alternatives per token as asked (the vocabulary permitting), ids in the vocabulary."""
        rid, scheduled = result.step_id, set(step.seq_ids)
        for x in result.prompt_logprobs:
            if x.seq_id not in scheduled:
                raise ProtocolError(f"result {rid} scores the prompt of seq {x.seq_id}, which its plan did not compute")
            seq = self.s.seqs.get(x.seq_id)
            if seq is None:
                continue  # finished or aborted since the plan was sent: dropped when applied
            k = seq.sampling.prompt_logprobs
            if k < 0 or x.start + len(x.token_logprobs) > seq.num_prompt_tokens:
                raise ProtocolError(f"result {rid} scores prompt tokens of seq {x.seq_id} it was not asked for")
            per_token = k if self.vocab_size is None else min(k, self.vocab_size)
            if len(x.top_token_ids) != per_token * len(x.token_logprobs):
                raise ProtocolError(f"result {rid} reports {len(x.top_token_ids)} prompt alternatives for "
                                    f"{len(x.token_logprobs)} tokens of seq {x.seq_id}; {per_token} each were asked for")
            if self.vocab_size is not None and x.top_token_ids and max(x.top_token_ids) >= self.vocab_size:
                raise ProtocolError(f"result {rid} reports token id {max(x.top_token_ids)} in prompt log-probs, "
                                    f"outside the vocabulary of {self.vocab_size}")

    def _check_logprobs(self, result: StepResult, due: list[Sequence]) -> None:
        want = [s for s in due if s.sampling.want_logprobs]
        if [x.seq_id for x in result.logprobs] != [s.seq_id for s in want]:
            raise ProtocolError(f"result {result.step_id} has log-probs for other sequences than asked for them")
        for seq, x in zip(want, result.logprobs, strict=True):
            self.check_top(result.step_id, x, seq.sampling.logprobs, "log-probs")

    def check_top(self, rid: int, x: SeqLogprobs, asked: int, what: str) -> None:
        if len(x.top_token_ids) > asked + 1:  # (the sampled token may come on top of the alternatives)
            raise ProtocolError(f"result {rid} reports {len(x.top_token_ids)} {what} for seq {x.seq_id}, "
                                f"{asked} were asked for")
        if self.vocab_size is not None and x.top_token_ids and max(x.top_token_ids) >= self.vocab_size:
            raise ProtocolError(f"result {rid} reports token id {max(x.top_token_ids)} in its {what}, outside "
                                f"the vocabulary of {self.vocab_size}")

    def process(self, result: StepResult, due: list[Sequence], beams: list[Sequence]) -> list[RequestUpdate]:
        """Apply a result that passed :meth:`check` (``due``, ``beams``: what it answers for)."""
        lps = {x.seq_id: x for x in result.logprobs} if result.logprobs else None
        out: list[RequestUpdate] = self._prompt_scores(result) if result.prompt_logprobs else []
        multi: dict[str, RequestUpdate] = {}  # n > 1: one update per request, several seqs
        for seq, tok in zip(due, result.sampled_token_ids, strict=True):
            try:
                sid = seq.seq_id
                if seq.finish_reason is not None:
                    continue  # finished or aborted after the plan was sent: the token is dropped
                seq.num_placeholders -= 1
                toks = seq.token_ids
                toks.append(tok)
                r = seq.request
                reason = end_reason(r, toks, tok)
                su = SeqUpdate(seq.index, [tok], token_logprob(lps.get(sid), tok) if lps else None, reason)
                if len(r.seqs) == 1:  # at most one token per sequence per step
                    ru = RequestUpdate(r.req.request_id, [su], False, seq.num_prompt_tokens,
                                       r.num_cached_prompt_tokens)
                    out.append(ru)
                else:
                    ru = multi.get(r.req.request_id)  # type: ignore[assignment]
                    if ru is None:
                        multi[r.req.request_id] = ru = RequestUpdate(
                            r.req.request_id, [su], False, seq.num_prompt_tokens, r.num_cached_prompt_tokens)
                        out.append(ru)
                    else:
                        ru.seqs.append(su)
                if reason is not None:
                    ru.finished = self.finish(seq, reason)
            except Exception as exc:  # noqa: BLE001  one request's failure must not reach the others
                if seq.request.request_id in self.s.requests:
                    out.append(self.s.fail_request(seq.request, exc))

        if beams or result.beam_candidates:
            self._beams(result.beam_candidates, beams, out)
        return out

    def process_steps(self, result: StepResult, due: list[Sequence], step: InFlight,
                      failed: set[int]) -> list[RequestUpdate]:
        """Apply a result of ``step.decode_steps`` k > 1 that passed :meth:`check`: each sequence's k
        tokens, up to the one that ends it (the rest were computed past its end and are dropped); the
        blocks its tokens filled go to the prefix cache before an end frees them. Its sequences are
        plain samplers, one per request (``DecodeStepPolicy.choose``)."""
        k, m, tokens = step.decode_steps, len(due), result.sampled_token_ids
        commit, to_commit = self.s.kv.commit_computed, {}
        for seq, residency, computed in step.to_commit:
            if seq.residency == residency and seq.seq_id not in failed:
                to_commit[seq.seq_id] = computed
        for s in step.sampling:
            if s.seq_id in failed:
                s.num_placeholders -= k  # its samples never come
        out: list[RequestUpdate] = []
        for i, seq in enumerate(due):
            try:
                if seq.finish_reason is not None:
                    continue  # finished or aborted after the plan was sent: the tokens are dropped
                seq.num_placeholders -= k
                toks, r = seq.token_ids, seq.request
                new, reason = tokens[i::m], None
                for j, tok in enumerate(new):
                    toks.append(tok)
                    reason = end_reason(r, toks, tok)
                    if reason is not None:
                        del new[j + 1:]
                        break
                if (computed := to_commit.get(seq.seq_id)) is not None:
                    commit(seq, min(computed, len(toks)))  # (positions past an end hold dropped tokens)
                ru = RequestUpdate(r.req.request_id, [SeqUpdate(seq.index, new, None, reason)], False,
                                   seq.num_prompt_tokens, r.num_cached_prompt_tokens)
                out.append(ru)
                if reason is not None:
                    ru.finished = self.finish(seq, reason)
            except Exception as exc:  # noqa: BLE001  one request's failure must not reach the others
                if seq.request.request_id in self.s.requests:
                    out.append(self.s.fail_request(seq.request, exc))
        return out

    def _prompt_scores(self, result: StepResult) -> list[RequestUpdate]:
        """The prompt scores of a checked result, one update each (before the step's tokens: the step
        that samples a sequence's first token scores the rest of its prompt)."""
        out = []
        for x in result.prompt_logprobs:
            seq = self.s.seqs.get(x.seq_id)
            if seq is None:
                continue
            r, k = seq.request, len(x.top_token_ids) // max(1, len(x.token_logprobs))
            toks, ranks = seq.token_ids, x.token_ranks or None
            scores = [TokenLogprob(toks[x.start + i], lp, x.top_token_ids[i * k:(i + 1) * k],
                                   x.top_logprobs[i * k:(i + 1) * k], ranks[i] if ranks else None)
                      for i, lp in enumerate(x.token_logprobs)]
            out.append(RequestUpdate(r.request_id, [], False, seq.num_prompt_tokens, r.num_cached_prompt_tokens,
                                     prompt_logprobs=PromptScores(x.start, scores)))
        return out

    def finish(self, seq: Sequence, reason: FinishReason) -> bool:
        """End ``seq`` for ``reason``; True when that ends its request (released)."""
        r = seq.request
        self.s.finish_seq(seq, reason)
        if not r.live and r.forked:
            self.s.release_request(r, None)
            return True
        return False

    def fail(self, seqs: list[Sequence], error: str, kind: ErrorKind = ErrorKind.FAILED) -> list[RequestUpdate]:
        """Fail (and free) every request that owns one of ``seqs``; ``error`` is what its client sees,
        ``kind`` the status it gets."""
        out, seen = [], set()
        for seq in seqs:
            r = seq.request
            if id(r) in seen or r.request_id not in self.s.requests:
                continue
            seen.add(id(r))
            self.s.release_request(r, FinishReason.ABORTED)
            out.append(RequestUpdate(r.request_id, [], True, r.num_prompt_tokens,
                                     r.num_cached_prompt_tokens, error=error, error_kind=kind))
        return out

    # ------------------------------------------------------------------ beam search
    def _beams(self, cands: list[SeqLogprobs], due: list[Sequence], updates: list[RequestUpdate]) -> None:
        by_req: dict[int, tuple[Request, dict[int, tuple[list[int], list[float]]]]] = {}
        for seq, c in zip(due, cands, strict=True):
            if seq.finish_reason is not None:
                continue  # pruned, finished or aborted after the plan was sent
            seq.num_placeholders -= 1
            r = seq.request
            if r.state is not RequestState.RUNNING:
                # Preempted after the plan was sent. Its next tokens depend on choosing among
                # all beams, so the step is redone after it is back: recompute restarts from
                # scratch anyway; a swapped beam recomputes its last position (same K/V).
                if r.state is RequestState.SWAPPED:
                    seq.num_computed_tokens -= 1
                continue
            entry = by_req.setdefault(id(r), (r, {}))
            entry[1][c.seq_id] = (c.top_token_ids, c.top_logprobs)
        for r, per_seq in by_req.values():
            try:
                self._beam_request(r, per_seq, updates)
            except Exception as exc:  # noqa: BLE001  one request's failure must not reach the others
                if r.request_id in self.s.requests:
                    updates.append(self.s.fail_request(r, exc))

    def _beam_request(self, r: Request, cands: dict[int, tuple[list[int], list[float]]],
                      updates: list[RequestUpdate]) -> None:
        s, p = self.s, r.req.params
        beams = list(r.live)
        length_reached = beams[0].num_tokens + 1 >= r.stop_len  # max_tokens, or the longest it may be
        lim = BeamLimits(r.eos_token_ids, frozenset(p.stop_token_ids),
                         p.length_penalty, p.early_stopping)
        running, done = beam_step(r.beam, beams, cands, length_reached, lim)  # type: ignore[arg-type]
        if not done:
            self._apply_beams(r, running)
            return
        hyps = final_hypotheses(r.beam, beams, lim)  # type: ignore[arg-type]
        s.release_request(r, FinishReason.LENGTH)
        updates.append(RequestUpdate(
            r.request_id, [SeqUpdate(i, h.output_token_ids, None, h.finish_reason) for i, h in enumerate(hyps)],
            True, r.num_prompt_tokens, r.num_cached_prompt_tokens))

    def _apply_beams(self, r: Request, running: list[BeamCandidate]) -> None:
        """Survivors continue: first choice of a parent reuses it, others fork it; the rest are freed."""
        s = self.s
        chosen: dict[int, list[BeamCandidate]] = {}
        for c in running:
            chosen.setdefault(c.parent.seq_id, []).append(c)
        for seq in list(r.live):
            if seq.seq_id not in chosen:
                s.finish_seq(seq, FinishReason.ABORTED)  # pruned: its blocks free at once
        for cs in chosen.values():
            parent = cs[0].parent
            for c in cs[1:]:
                child = s.new_seq(r, len(r.seqs), list(parent.token_ids) + [c.token_id], parent.sampling)
                child.num_computed_tokens = parent.num_computed_tokens
                s.kv.fork(parent, child)
                child.fork_parent = parent.seq_id  # the executor copies parent before appends
                child.owed_tokens.append(c.token_id)
                child.cum_logprob = c.score
            parent.token_ids.append(cs[0].token_id)
            parent.owed_tokens.append(cs[0].token_id)
            parent.cum_logprob = cs[0].score
        r.seqs = list(r.live)


def end_reason(r: Request, toks: list[int], tok: int) -> FinishReason | None:
    """Why a sequence ends with ``tok``, just appended to its ``toks`` (None: it goes on). The one
    check of every token the scheduler appends (one step's, several steps', speculative ones)."""
    if tok in r.eos_token_ids:
        return FinishReason.EOS
    if tok in r.stop_token_ids:
        return FinishReason.STOP
    if len(toks) >= r.stop_len:
        return FinishReason.LENGTH
    return None


def token_logprob(x: SeqLogprobs | None, tok: int) -> list[TokenLogprob] | None:
    if x is None:
        return None
    return [TokenLogprob(tok, x.token_logprob, x.top_token_ids, x.top_logprobs)]
