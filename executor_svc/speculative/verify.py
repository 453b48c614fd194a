"""Verify a step's proposals with the sampler itself, position by position (the runner's path).

A speculating sequence (``BatchPlan.proposals``) ran its last token and its k proposals in the
step's one forward, so there is a logits row for each of the k + 1 positions. Verification walks
them in order: it samples position j exactly as a plain decode step would (the real
:class:`~executor_svc.sampler.Sampler`, over the sequence's tokens so far, so penalties,
``min_tokens``, logit bias, temperature, truncation and log-probs mean what they always mean),
emits that token, and goes on while it equals proposal j. So every emitted token is the token
plain decoding would have drawn at that position:

* greedy: the argmax, as plain decoding;
* sampled: a draw from the target's distribution; for a point-mass proposal x (the n-gram
  method) "draw, accept while equal" accepts x with probability p(x) and otherwise emits a draw
  from p without x, which is exactly rejection sampling (Leviathan et al. 2023) for such a
  proposal;
* seeded: the sampler's uniform depends on (seed, output position) only, one per emitted token,
  so a seeded request emits the same tokens with speculation on and off.

A draft model's proposals (``draft.py``) on sampled rows carry the draft's distribution q: there
the walk is rejection sampling proper (Leviathan et al. 2023): proposal d at position j is accepted
with probability min(1, p(d) / q(d)), p the target's distribution as the sampler processes it;
on rejection the position emits a draw from norm(max(0, p - q)) and the walk ends; when all are
accepted the last row samples the bonus token plainly. Every emitted token is then distributed
as p (the point-mass case above is q = one-hot). Greedy and seeded draft rows carry no q and take
the walk above (the draft proposed its argmax, or drew with the target's own uniform of the
position), so their tokens are those of decoding without speculation whatever k and the batch;
a row with q and a seed draws acceptance and residual from (seed, position) streams. Log-probs are always the target's.

A constrained sequence (structured outputs) walks under its grammar: each position's row is masked
by the grammar's state after the tokens emitted before it (a fork of the sequence's matcher, so
the sequence's own grammar takes only what is reported), so a proposal the grammar rejects has no
probability and is cut there, and every emitted token is one plain constrained decoding could emit.
A position where the grammar allows no token ends the walk before it: the next step meets it and
rejects the request, as plain decoding does.

The first emitted token is reported like any sampled token; the others in ``StepResult.spec_tokens``.
"""

from __future__ import annotations

import torch

from executor_svc.batch import Batch, SeqState
from executor_svc.grammar import GrammarBackend, GrammarMasks, SeqGrammar
from executor_svc.sampler import SampleOutput, Sampler, TokenLogprobs, draw_token, token_logprobs
from pagedserve.wire import BatchPlan, SeqLogprobs, SpecTokens, StepResult

ACCEPT_SALT = 0xACCE97  # the seeded stream of the p/q acceptance tests


def rejection_step(p: torch.Tensor, q: torch.Tensor, d: int, u_accept: float, u_resid: float) -> tuple[int, bool]:
    """One position of rejection sampling: proposal ``d`` drawn from q [vocab], the target's p
    [vocab]. Accept d with probability min(1, p(d) / q(d)); else draw from norm(max(0, p - q))
    (p itself if that is empty, which only rounding allows). -> (token, accepted)."""
    if u_accept * float(q[d]) < float(p[d]):  # (u < p/q without dividing; q(d) > 0: d was drawn from q)
        return d, True
    resid = (p - q).clamp_min_(0.0)
    if not float(resid.sum()) > 0.0:
        resid = p
    return draw_token(resid, u_resid), False


class WalkGrammar:
    """A constrained sequence's grammar along its verification walk: a fork of its state, which
    masks each position's row and takes each emitted token (the sequence's own grammar takes them
    when they are reported). ``grammar`` is read by :meth:`GrammarBackend.masks`."""

    def __init__(self, backend: GrammarBackend, grammar: SeqGrammar) -> None:
        self.backend, self.grammar = backend, grammar.fork()

    def masks(self) -> GrammarMasks | None:
        """The mask of the walk's next position, as the one row of a sample."""
        return self.backend.masks([self])

    def accept(self, token_id: int) -> None:
        self.grammar.accept(token_id)


_DEAD_END = object()


def _position_masks(walk: WalkGrammar | None, j: int) -> GrammarMasks | None | object:
    """The mask of walk position ``j`` (None: unconstrained), or ``_DEAD_END`` where, past the first
    position, the grammar allows no token. The walk stops before such a position: what was emitted
    is the grammar's, and the sequence's next step meets the dead end and rejects the request
    (``NO_TOKEN_ALLOWED``), as decoding without speculation does; sampled unmasked, the token would
    break the grammar, a failure counted against the executor. (At the first position the step's
    own masks already failed such a row: it has no walk.)"""
    if walk is None:
        return None
    masks = walk.masks()
    return _DEAD_END if j and masks is not None and masks.failed else masks


def _sample_row(sampler: Sampler, row: torch.Tensor, s: SeqState, masks: GrammarMasks | None) -> SampleOutput:
    """One position sampled as plain decoding samples it: the sampler applies the walk's mask, after
    taking raw log-probs from the unmasked logits."""
    return sampler.sample(row[None].clone(), [s], masks)


def _draft_walk(sampler: Sampler, s: SeqState, props: list[int], rows: list[torch.Tensor],
                walk: WalkGrammar | None) -> tuple[list[int], list[TokenLogprobs | None]]:
    """A sampled row's draft proposals through :func:`rejection_step`, then the bonus token; the
    tokens are appended to ``s.token_ids`` as they are emitted (the caller takes them back)."""
    emitted: list[int] = []
    lps: list[TokenLogprobs | None] = []
    for j, d in enumerate(props):
        row = rows[j]
        if (masks := _position_masks(walk, j)) is _DEAD_END:
            return emitted, lps
        if masks is not None:
            row = row[None].clone()
            masks.apply(row)
            row = row[0]
        p = sampler.probs(row, s)
        tok, accepted = rejection_step(p, s.draft_q[j], d, sampler.uniform(s, ACCEPT_SALT), sampler.uniform(s))
        emitted.append(tok)
        lps.append(token_logprobs(rows[j], p, s.sampling, tok))  # (raw mode: unmasked, as plain decoding)
        s.token_ids.append(tok)
        if walk is not None:
            walk.accept(tok)
        if not accepted:
            return emitted, lps
    if (masks := _position_masks(walk, len(props))) is _DEAD_END:
        return emitted, lps
    o = _sample_row(sampler, rows[len(props)], s, masks)
    emitted.append(o.token_ids[0])
    lps.append(o.logprobs[0])
    s.token_ids.append(o.token_ids[0])
    return emitted, lps


def speculating_rows(plan: BatchPlan, batch: Batch, seqs: dict[int, SeqState]) -> list[tuple[SeqState, list[int], int]]:
    """(sequence, proposals, row of its last committed token) per proposing sequence, plan order."""
    order = {sid: i for i, sid in enumerate(plan.scheduled_seq_ids)}
    ends = batch.meta.query_start_loc_host[1:]
    out = []
    for prop in plan.proposals:
        s = seqs[prop.seq_id]
        props = s.proposals or []
        out.append((s, props, ends[order[prop.seq_id]] - len(props) - 1))
    return out


def verify_proposals(sampler: Sampler, batch: Batch, last_rows: list[torch.Tensor], out: SampleOutput,
                     index: dict[int, int], grammar: GrammarBackend | None = None,
                     unserved: frozenset[int] = frozenset()) -> dict[int, tuple[list[int], list[TokenLogprobs | None]]]:
    """Each speculating sequence's emitted tokens: the first goes into ``out`` at its sampling row,
    the rest are returned (seq_id -> tokens, their log-probs). The sequences' tokens are left as
    they were before the proposals; the caller appends what is emitted. ``unserved``: the sampling
    rows whose grammar cannot be served (they fail; their walk is not constrained)."""
    extras = {}
    for (s, props, _), early, last in zip(batch.spec, batch.spec_logits, last_rows, strict=True):
        del s.token_ids[len(s.token_ids) - len(props):]  # back to the committed tokens
        rows = [*early, last]
        walk = None
        if s.grammar is not None and grammar is not None and index[s.seq_id] not in unserved:
            walk = WalkGrammar(grammar, s.grammar)
        if s.draft_q is not None:
            emitted, lps = _draft_walk(sampler, s, props, rows, walk)
        else:
            emitted, lps = [], []
            for j, row in enumerate(rows):
                if (masks := _position_masks(walk, j)) is _DEAD_END:
                    break
                o = _sample_row(sampler, row, s, masks)
                tok = o.token_ids[0]
                emitted.append(tok)
                lps.append(o.logprobs[0])
                s.token_ids.append(tok)
                if walk is not None:
                    walk.accept(tok)
                if j == len(props) or tok != props[j]:
                    break
        del s.token_ids[len(s.token_ids) - len(emitted):]
        if s.drafted:  # the draft's K/V holds the committed tokens and the accepted proposals at most
            s.draft_computed = min(s.draft_computed, len(s.token_ids) + len(emitted) - 1)
            s.drafted, s.draft_q = False, None
        i = index[s.seq_id]
        out.token_ids[i], out.logprobs[i] = emitted[0], lps[0]
        extras[s.seq_id] = (emitted[1:], lps[1:])
        s.proposals = None
    return extras


def report_spec_tokens(batch: Batch, extras: dict[int, tuple[list[int], list[TokenLogprobs | None]]],
                       result: StepResult) -> None:
    """After the first tokens were reported and appended: the rest, appended and reported; each
    sequence's computed count then covers every token whose K/V is valid (all but its newest)."""
    for s, _, _ in batch.spec:
        if s.seq_id not in extras or s.seq_id in result.failed_seq_ids:
            continue
        toks, lps = extras[s.seq_id]
        s.token_ids.extend(toks)
        if s.grammar is not None:  # (the first token's was taken with the step's samples)
            for tok in toks:
                s.grammar.accept(tok)
        s.num_computed_tokens = len(s.token_ids) - 1
        result.spec_tokens.append(SpecTokens(s.seq_id, toks, [
            SeqLogprobs(s.seq_id, lp.token_logprob, lp.top_token_ids, lp.top_logprobs) for lp in lps if lp is not None]))
