"""Turning a StepResult into token appends, stop decisions and RequestUpdates.

Split from scheduler.py so the hot loop over sampled tokens stays readable.
Sampled tokens are appended (the executor appended them on its side too);
beam requests go through :mod:`scheduler_svc.beam_search`, whose chosen
continuations become forks and ``append_tokens`` owed to the executor.
"""

from __future__ import annotations

from pagedserve.wire import SeqLogprobs, StepResult
from scheduler_svc.api_types import FinishReason, TokenLogprob
from scheduler_svc.beam_search import BeamCandidate, BeamLimits, beam_step, final_hypotheses
from scheduler_svc.lifecycle import RequestLifecycle
from scheduler_svc.request import Request, RequestUpdate, Sequence, SeqUpdate


class OutputProcessor:
    def __init__(self, sched: RequestLifecycle) -> None:
        self.s = sched

    def process(self, result: StepResult) -> list[RequestUpdate]:
        s = self.s
        seqs = s.seqs
        lps = {x.seq_id: x for x in result.logprobs} if result.logprobs else None
        out: list[RequestUpdate] = []
        multi: dict[str, RequestUpdate] = {}  # n > 1: one update per request, several seqs
        for sid, tok in zip(result.sampled_seq_ids, result.sampled_token_ids, strict=True):
            seq = seqs.get(sid)
            if seq is None:
                continue  # finished or aborted while the step ran
            toks = seq.token_ids
            if seq.num_computed_tokens != len(toks):
                raise ValueError(f"result samples seq {sid}, which had tokens left to compute")
            toks.append(tok)
            r = seq.request
            if tok in r.eos_token_ids:
                reason: FinishReason | None = FinishReason.EOS
            elif tok in r.stop_token_ids:
                reason = FinishReason.STOP
            elif len(toks) >= r.stop_len:
                reason = FinishReason.LENGTH
            else:
                reason = None
            su = SeqUpdate(seq.index, [tok], _token_logprob(lps.get(sid), tok) if lps else None, reason)
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
                ru.finished = self._finish(seq, reason)
        if result.beam_candidates:
            self._beams(result.beam_candidates, out)
        return out

    def _finish(self, seq: Sequence, reason: FinishReason) -> bool:
        r = seq.request
        self.s.finish_seq(seq, reason)
        if not r.live and r.forked:
            self.s.release_request(r, None)
            return True
        return False

    def fail(self, seqs: list[Sequence], error: str) -> list[RequestUpdate]:
        """The step failed as a whole: fail (and free) every request it computed for."""
        out, seen = [], set()
        for seq in seqs:
            r = seq.request
            if id(r) in seen or r.request_id not in self.s.requests:
                continue
            seen.add(id(r))
            self.s.release_request(r, FinishReason.ABORTED)
            out.append(RequestUpdate(r.request_id, [], True, r.num_prompt_tokens,
                                     r.num_cached_prompt_tokens, error=error))
        return out

    # ------------------------------------------------------------------ beam search
    def _beams(self, cands: list[SeqLogprobs], updates: list[RequestUpdate]) -> None:
        by_req: dict[int, tuple[Request, dict[int, tuple[list[int], list[float]]]]] = {}
        for c in cands:
            seq = self.s.seqs.get(c.seq_id)
            if seq is None or seq.request.beam is None:
                continue
            if seq.num_computed_tokens != seq.num_tokens:
                raise ValueError(f"beam candidates for seq {c.seq_id}, which had tokens left to compute")
            entry = by_req.setdefault(id(seq.request), (seq.request, {}))
            entry[1][c.seq_id] = (c.top_token_ids, c.top_logprobs)
        for r, per_seq in by_req.values():
            self._beam_request(r, per_seq, updates)

    def _beam_request(self, r: Request, cands: dict[int, tuple[list[int], list[float]]],
                      updates: list[RequestUpdate]) -> None:
        s, p = self.s, r.req.params
        beams = list(r.live)
        length_reached = (beams[0].num_output_tokens + 1 >= p.max_tokens
                          or beams[0].num_tokens + 1 >= s.config.max_model_len)
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
                child.pending_tokens.append(c.token_id)
                child.cum_logprob = c.score
            parent.token_ids.append(cs[0].token_id)
            parent.pending_tokens.append(cs[0].token_id)
            parent.cum_logprob = cs[0].score
        r.seqs = list(r.live)


def _token_logprob(x: SeqLogprobs | None, tok: int) -> list[TokenLogprob] | None:
    if x is None:
        return None
    return [TokenLogprob(tok, x.token_logprob, x.top_token_ids, x.top_logprobs)]
