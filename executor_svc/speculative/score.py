"""Score proposals in one forward: the last accepted token and k proposals per sequence.

The batch is built like a chunked prefill (several query tokens per sequence, ``build_batch``),
so the paged attention kernels that serve prefills serve verification too, on the CPU and CUDA
alike, and the K/V of all k + 1 positions is written as they run. Positions the verification
rejects hold stale K/V past the new computed count; the next step overwrites those slots before
any query can attend to them (attention reads only positions below its sequence length).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from executor_svc.attention import AttentionBackend
from executor_svc.batch import SeqState, build_batch
from executor_svc.kv_cache import KVCache
from executor_svc.model.llama import LlamaForCausalLM
from executor_svc.speculative.rejection import verify_greedy


def score_proposals(model: LlamaForCausalLM, kv: KVCache, backend: AttentionBackend,
                    seqs: Sequence[SeqState], proposals: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Per sequence, logits [k + 1, vocab] float32: row i scores the token after proposal i - 1.

    Each sequence must have every token but its last computed, and blocks for k more tokens."""
    views: dict[int, SeqState] = {}
    for s, p in zip(seqs, proposals, strict=True):
        if s.num_computed_tokens != len(s.token_ids) - 1:
            raise ValueError(f"seq {s.seq_id}: {len(s.token_ids) - s.num_computed_tokens} tokens to compute, "
                             f"verification needs exactly the last one")
        if -(-(len(s.token_ids) + len(p)) // kv.block_size) > len(s.block_ids):
            raise ValueError(f"seq {s.seq_id}: blocks for {len(p)} proposals were not reserved")
        views[s.seq_id] = dataclasses.replace(s, token_ids=s.token_ids + list(p))  # the state itself is untouched
    ids = [s.seq_id for s in seqs]
    batch = build_batch(views, kv.block_size, model.device, ids, [len(p) + 1 for p in proposals])
    input_ids = torch.tensor(batch.token_ids, dtype=torch.int64, device=model.device)
    with torch.inference_mode():
        hidden, every_row = model.forward_with_logits(input_ids, batch.positions, kv.layers, batch.meta, backend)
        logits = every_row if every_row is not None else model.compute_logits(hidden)
    ends = batch.meta.query_start_loc_host[1:]
    return [logits[end - len(p) - 1:end] for end, p in zip(ends, proposals, strict=True)]


def accept_greedy(seq: SeqState, proposals: Sequence[int], logits: torch.Tensor) -> list[int]:
    """Greedy verification applied to the sequence's state: its accepted proposals and the target's
    next token are appended, and its computed count covers exactly the tokens whose K/V is valid."""
    emitted = verify_greedy(proposals, logits.argmax(dim=-1).tolist())
    seq.num_computed_tokens = len(seq.token_ids) + len(emitted) - 1  # all but the newly sampled token
    seq.token_ids.extend(emitted)
    return emitted
