"""The draft model of speculative decoding: a smaller model with the target's tokenizer, run by
the executor on paged KV pools of its own that share the target's block ids (one block table, two
pools: the plan's allocations, frees, copies and swaps serve both; ``seq_deltas.py`` moves both).

A plan names the sequences that propose and how many tokens (``BatchPlan.draft_proposals``); their
slots are already in their tables, exactly as for n-gram proposals. At the start of the step that
verifies them (``ModelRunner.launch``), :meth:`DraftModel.propose` runs the draft k times over
those sequences: the first forward catches the draft up on every committed token it has not seen
(``SeqState.draft_computed`` up to the last one: the prompt on a sequence's first proposal, the
last accepted proposal and the bonus token after that) and drafts the first token; each further
forward decodes the token drafted before. Greedy rows draft the argmax and seeded rows draw with
the uniform the target draws that position with (both verified "draw, keep while equal", so their
tokens are those of decoding without speculation); unseeded sampled rows draw from the draft's
distribution q (the sampler's own processing of the draft's logits), kept for the verifier's p/q
rule (``verify.py``). Correctness never depends on the draft's KV: the target
verifies every token; a stale or missing draft K/V only lowers acceptance.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.attention import AttentionBackend
from executor_svc.batch import SeqState, build_batch
from executor_svc.kv_cache import KVCache
from executor_svc.model.llama import LlamaForCausalLM
from executor_svc.sampler import Sampler, draw_token
from pagedserve.wire import GREEDY_TEMPERATURE_EPS, SamplingParams

SHORT_BACKLOG = 4  # tokens a sequence's draft catches up on one decode step at a time (more: one chunk)


@dataclass(slots=True)
class _Context:
    """What the sampler reads of a sequence at a drafted position (its tokens up to there)."""

    sampling: SamplingParams
    token_ids: list[int]
    num_prompt_tokens: int


class DraftModel:
    def __init__(self, model: LlamaForCausalLM, kv: KVCache, backend: AttentionBackend, sampler: Sampler,
                 name: str) -> None:
        self.model, self.kv, self.backend, self.sampler, self.name = model, kv, backend, sampler, name

    def propose(self, todo: list[tuple[SeqState, int]]) -> None:
        """Each (sequence, k): its k proposals drafted into ``s.proposals`` and the k placeholder
        tokens at the end of ``s.token_ids`` (the runner appended them for the step's batch)."""
        base = {s.seq_id: len(s.token_ids) - k for s, k in todo}  # committed tokens
        views: dict[int, SeqState] = {}
        drafted = {s.seq_id: 0 for s, _ in todo}
        for s, _ in todo:  # the draft's view: the same tokens and table, its own computed count
            views[s.seq_id] = SeqState(s.seq_id, s.token_ids, s.num_prompt_tokens, s.block_ids,
                                       min(s.draft_computed, base[s.seq_id] - 1), s.sampling)
            s.draft_q = [] if _rejection_sampled(s.sampling) else None
        while active := [s for s, k in todo if drafted[s.seq_id] < k]:
            # Each forward takes a sequence's whole backlog as one chunk when it is long (a prompt),
            # else one token: a short backlog (the last accepted proposal and the bonus token) then
            # runs as decode steps, which the fused CPU decode stack serves far cheaper than a chunk.
            ids = [s.seq_id for s in active]
            backlog = [base[sid] + drafted[sid] - views[sid].num_computed_tokens for sid in ids]
            num_new = [n if n > SHORT_BACKLOG else 1 for n in backlog]
            logits = self._forward(views, ids, num_new)
            for i, s in enumerate(active):
                views[s.seq_id].num_computed_tokens += num_new[i]
                if num_new[i] == backlog[i]:  # caught up: this row drafts the next token
                    at = base[s.seq_id] + drafted[s.seq_id]
                    s.token_ids[at] = s.proposals[drafted[s.seq_id]] = self._draw(logits[i], s, at)
                    drafted[s.seq_id] += 1
        for s, k in todo:
            s.draft_computed = base[s.seq_id] + k - 1  # (the last draft token's K/V was never needed)

    def _forward(self, views: dict[int, SeqState], ids: list[int], num_new: list[int]) -> torch.Tensor:
        """One draft forward of ``num_new`` tokens per sequence -> their last rows' logits [n, vocab]."""
        batch = build_batch(views, self.kv.block_size, self.model.device, ids, num_new).place()
        with torch.inference_mode():
            input_ids = torch.tensor(batch.token_ids, dtype=torch.int64, device=self.model.device)
            hidden, step_logits = self.model.forward_with_logits(input_ids, batch.positions, self.kv.layers,
                                                                 batch.meta, self.backend)
            rows = [end - 1 for end in batch.meta.query_start_loc_host[1:]]
            if step_logits is not None:
                return step_logits[rows]
            return self.model.compute_logits(hidden[torch.tensor(rows, device=hidden.device)])

    def _draw(self, row: torch.Tensor, s: SeqState, at: int) -> int:
        """The drafted token at position ``at``: what the sampler draws from the draft's row as it
        would from the target's (the argmax for greedy rows; for seeded rows a draw with the target's
        own uniform of that position, so where q is near p the draft draws the token the target
        will), or for unseeded sampled rows a draw from q (kept in ``s.draft_q``)."""
        ctx = _Context(s.sampling, s.token_ids[:at], s.num_prompt_tokens)
        if s.draft_q is None:
            return int(self.sampler.sample(row[None].clone(), [ctx]).token_ids[0])
        q = self.sampler.probs(row, ctx)
        s.draft_q.append(q)
        return draw_token(q, self.sampler.uniform(ctx))


def _rejection_sampled(p: SamplingParams) -> bool:
    """Whether a sequence's draft proposals are verified by the p/q rule (unseeded sampled rows).
    Greedy and seeded rows are verified as n-gram proposals are ("draw, keep while equal"), so their
    tokens are those of decoding without speculation: a seed promises the same tokens whatever k
    and whatever else shares the steps (the p/q rule's tokens depend on where each proposal round
    starts, which the batch and the step's budget decide)."""
    return p.temperature >= GREEDY_TEMPERATURE_EPS and p.seed is None
