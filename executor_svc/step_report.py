"""What a step reports besides its forward: its sampling rows' logits, its sampled tokens and the
prompt tokens it scores.

Kept apart from the runner's phases (``runner.py``): these turn the sampler's output and the
model's hidden states into the ``StepResult``'s entries, and append each sampled token to its
sequence, the one place the executor's state grows by a token it chose itself.
"""

from __future__ import annotations

import logging
from collections.abc import Set as AbstractSet

import torch

from executor_svc.batch import Batch, SeqState
from executor_svc.grammar import GrammarBackend, GrammarMasks
from executor_svc.model.llama import LlamaForCausalLM
from executor_svc.sampler import SampleOutput, Sampler
from executor_svc.speculative.verify import report_spec_tokens, verify_proposals
from pagedserve.wire import (
    MAX_REJECTION_CHARS,
    MAX_TEXT_CHARS,
    PromptLogprobs,
    SeqLogprobs,
    SeqRejection,
    StepResult,
)

log = logging.getLogger(__name__)
PROMPT_SLICE = 256  # prompt rows scored at once (their logits are [rows, vocab] float32)


def score_prompt(model: LlamaForCausalLM, hidden: torch.Tensor, s: SeqState, first: int, row: int,
                 count: int) -> PromptLogprobs:
    """Prompt tokens ``first .. first + count - 1`` of ``s``, scored by the raw log-softmax of the
    logits of the rows before them, with their ranks and the top ``prompt_logprobs`` alternatives;
    in slices, so a long prompt never holds [prompt, vocab] logits at once."""
    k = min(s.sampling.prompt_logprobs, model.cfg.vocab_size)
    lps: list[float] = []
    ranks: list[int] = []
    top_ids: list[int] = []
    top_vals: list[float] = []
    targets = torch.tensor(s.token_ids[first:first + count], dtype=torch.int64, device=hidden.device)
    for at in range(0, count, PROMPT_SLICE):
        n = min(PROMPT_SLICE, count - at)
        lp = torch.log_softmax(model.compute_logits(hidden[row + at:row + at + n]).float(), dim=-1)
        own = lp.gather(1, targets[at:at + n, None])
        lps += own[:, 0].tolist()
        ranks += ((lp > own).sum(dim=-1) + 1).tolist()  # (vLLM's rank: 1 + the tokens more likely)
        if k:
            vals, ids = torch.topk(lp, k, dim=-1)
            top_ids += ids.flatten().tolist()
            top_vals += vals.flatten().tolist()
    return PromptLogprobs(s.seq_id, first, lps, top_ids, top_vals, ranks)


def sampling_logits(model: LlamaForCausalLM, hidden: torch.Tensor, batch: Batch,
                    step_logits: torch.Tensor | None) -> torch.Tensor | None:
    """A forward's hidden states [num_tokens, hidden] -> the logits of its sampling rows [rows, vocab]
    float32 (None if none); the prompt tokens the batch scores, into ``batch.prompt_scores``, and a
    speculating sequence's rows, into ``batch.spec_logits``. ``step_logits``: every row's logits when
    the forward computed them (the fused CPU decode step)."""
    for s, first, row, count in batch.prompt_rows:
        batch.prompt_scores.append(score_prompt(model, hidden, s, first, row, count))
    for _seq, props, row in batch.spec:  # rows scoring the last token and all proposals but the last
        rows = slice(row, row + len(props))
        batch.spec_logits.append(step_logits[rows] if step_logits is not None else model.compute_logits(hidden[rows]))
    rows_list = batch.logits_rows
    if not rows_list:
        return None
    if len(rows_list) == hidden.shape[0] and rows_list[-1] == len(rows_list) - 1:  # every row samples
        return step_logits if step_logits is not None else model.compute_logits(hidden)  # (no gather)
    rows = torch.tensor(rows_list, dtype=torch.int64, device=hidden.device)
    if step_logits is not None:
        return step_logits.index_select(0, rows)
    return model.compute_logits(hidden.index_select(0, rows))


def report_samples(seqs: list[SeqState], out: SampleOutput, result: StepResult, failed: dict[int, str],
                   grammar: GrammarBackend | None, rejected: AbstractSet[int] = frozenset()) -> list[int]:
    """Append the sampled tokens to their sequences and report them in ``result``; the rows in
    ``failed`` (row -> why: their grammar cannot be served; sampled unmasked) are reported failed
    instead: the sequences the caller must drop; those of them in ``rejected`` (their request's own
    grammar is at fault) also in ``result.rejected``, with the reason. RuntimeError, nothing
    appended, when a row that should have a token has none."""
    for i, s in enumerate(seqs):  # every row checked before any is appended: all or nothing
        if out.beam[i] is None and out.token_ids[i] is None and i not in failed:
            raise RuntimeError(f"sampler returned no token for seq {s.seq_id}")
    constrained = [(s.grammar, out.token_ids[i]) for i, s in enumerate(seqs) if s.grammar is not None
                   and out.beam[i] is None and i not in failed]
    if constrained:  # (masked by their grammars: accepted; a terminated matcher takes no more)
        if grammar is not None:
            grammar.accept([g for g, _ in constrained], [t for _, t in constrained])
        else:
            for g, tok in constrained:
                g.accept(tok)
    for i, s in enumerate(seqs):
        if i in failed:
            continue
        beam = out.beam[i]
        if beam is not None:
            result.beam_candidates.append(SeqLogprobs(s.seq_id, 0.0, beam.top_token_ids, beam.top_logprobs))
            continue
        tok = out.token_ids[i]
        lp = out.logprobs[i]
        if lp is not None:
            result.logprobs.append(SeqLogprobs(s.seq_id, lp.token_logprob, lp.top_token_ids, lp.top_logprobs))
        s.token_ids.append(tok)
        result.sampled_seq_ids.append(s.seq_id)
        result.sampled_token_ids.append(tok)
    if not failed:
        return []
    reasons = [f"seq {seqs[i].seq_id}: {why}" for i, why in failed.items()]
    log.warning("step %d: %d sequences fail, their grammar cannot be served: %s", result.step_id,
                len(failed), "; ".join(reasons))
    result.failed_seq_ids.extend(seqs[i].seq_id for i in failed)
    result.rejected.extend(SeqRejection(seqs[i].seq_id, failed[i][:MAX_REJECTION_CHARS]) for i in failed if i in rejected)
    result.error = ("structured outputs: " + "; ".join(reasons))[:MAX_TEXT_CHARS]
    return [seqs[i].seq_id for i in failed]


def report_greedy(batch: Batch, tokens: list[int], result: StepResult, grammar: GrammarBackend | None) -> None:
    """Report a step whose greedy tokens were taken on the device (no row constrained: none fails)."""
    seqs = batch.sample_seqs
    report_samples(seqs, SampleOutput(tokens, [None] * len(seqs), [None] * len(seqs)), result, {}, grammar)


def step_masks(grammar: GrammarBackend | None, batch: Batch | None) -> GrammarMasks | None:
    """The grammar masks of a batch's sampling rows (None: no row is constrained); computed while
    the forward runs on the device."""
    if batch is None or not any(s.grammar is not None for s in batch.sample_seqs):
        return None
    if grammar is None:
        return GrammarMasks.unserved(batch.sample_seqs)
    return grammar.masks(batch.sample_seqs)


def sample_rows(sampler: Sampler, batch: Batch, logits: torch.Tensor, result: StepResult,
                masks: GrammarMasks | None, grammar: GrammarBackend | None) -> list[int]:
    """Sample a step's rows (a speculating sequence's proposals verified against its rows), append
    and report the tokens (:func:`report_samples`); the sequences the caller must drop."""
    seqs = batch.sample_seqs
    failed = masks.failed if masks is not None else {}
    rejected = masks.rejected if masks is not None else frozenset()
    if not batch.spec:
        return report_samples(seqs, sampler.sample(logits, seqs, masks), result, failed, grammar, rejected)
    index = {s.seq_id: i for i, s in enumerate(seqs)}
    last_rows = [logits[index[s.seq_id]].clone() for s, _, _ in batch.spec]  # (the sampler edits logits)
    out = sampler.sample(logits, seqs, masks)  # (speculating rows: replaced below)
    extras = verify_proposals(sampler, batch, last_rows, out, index, grammar, frozenset(failed))
    dropped = report_samples(seqs, out, result, failed, grammar, rejected)
    report_spec_tokens(batch, extras, result)
    return dropped
