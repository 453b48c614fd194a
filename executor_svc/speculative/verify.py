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

The first emitted token is reported like any sampled token; the others in ``StepResult.spec_tokens``.
"""

from __future__ import annotations

import torch

from executor_svc.batch import Batch, SeqState
from executor_svc.sampler import SampleOutput, Sampler, TokenLogprobs
from pagedserve.wire import BatchPlan, SeqLogprobs, SpecTokens, StepResult


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
                     index: dict[int, int]) -> dict[int, tuple[list[int], list[TokenLogprobs | None]]]:
    """Each speculating sequence's emitted tokens: the first goes into ``out`` at its sampling row,
    the rest are returned (seq_id -> tokens, their log-probs). The sequences' tokens are left as
    they were before the proposals; the caller appends what is emitted."""
    extras = {}
    for (s, props, _), early, last in zip(batch.spec, batch.spec_logits, last_rows, strict=True):
        del s.token_ids[len(s.token_ids) - len(props):]  # back to the committed tokens
        rows = [*early, last]
        emitted: list[int] = []
        lps: list[TokenLogprobs | None] = []
        for j, row in enumerate(rows):
            o = sampler.sample(row[None].clone(), [s])
            tok = o.token_ids[0]
            emitted.append(tok)
            lps.append(o.logprobs[0])
            s.token_ids.append(tok)
            if j == len(props) or tok != props[j]:
                break
        del s.token_ids[len(s.token_ids) - len(emitted):]
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
        s.num_computed_tokens = len(s.token_ids) - 1
        result.spec_tokens.append(SpecTokens(s.seq_id, toks, [
            SeqLogprobs(s.seq_id, lp.token_logprob, lp.top_token_ids, lp.top_logprobs) for lp in lps if lp is not None]))
