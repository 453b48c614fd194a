"""A plan's deltas on the executor: its sequences' state and its KV cache's block moves.

The walk (the order ``pagedserve/wire/messages.py`` documents) is the shared
``pagedserve/wire/plan_deltas.py``; this is what it does on a real executor: a sequence's
:class:`SeqState` (tokens, block table, computed count, sampling parameters, its grammar's
matcher, the prompt log-probs it is owed) and the swaps and copies of KV blocks, which only the
executor performs. The plan was checked as a whole first (``plan_check.py``).
"""

from __future__ import annotations

from array import array

from executor_svc.attention import AttentionBackend
from executor_svc.batch import SeqState
from executor_svc.grammar import GrammarBackend, SeqGrammar, unserved
from executor_svc.kv_cache import KVCache
from executor_svc.lora.served import LoraSlotsOfRunner
from pagedserve.wire import SamplingParams
from pagedserve.wire.messages import BlockUpdate, Fork, LoraLoad, NewSeq
from pagedserve.wire.plan_deltas import DeltaError, DeltaTarget, Pairs


class ExecutorDeltas(DeltaTarget[SeqState]):
    def __init__(self, kv: KVCache, backend: AttentionBackend, grammar: GrammarBackend | None,
                 lora: LoraSlotsOfRunner | None = None, seqs: dict[int, SeqState] | None = None,
                 draft_kv: KVCache | None = None) -> None:
        self.kv, self.backend, self.grammar, self.lora, self.seqs = kv, backend, grammar, lora, seqs or {}
        # A draft model's pools (speculative decoding): the same block ids, so every move is made in both.
        self.pools = [kv] if draft_kv is None else [kv, draft_kv]

    def load_lora(self, load: LoraLoad) -> None:
        if self.lora is None or load.slot >= self.lora.num_slots:
            raise DeltaError(f"a LoRA load into slot {load.slot}: this executor has "
                             f"{0 if self.lora is None else self.lora.num_slots} (--max-loras)")
        self.lora.load(load, [sid for sid, s in self.seqs.items() if s.lora_slot == load.slot])

    def swap_out(self, pairs: Pairs) -> None:
        for kv in self.pools:
            self.backend.swap(kv.layers, kv.cpu_layers, pairs)

    def swap_in(self, pairs: Pairs) -> None:
        for kv in self.pools:
            self.backend.swap(kv.cpu_layers, kv.layers, pairs)

    def copy_blocks(self, pairs: Pairs) -> None:
        for kv in self.pools:
            self.backend.copy_blocks(kv.layers, pairs)

    def new_seq(self, s: NewSeq) -> SeqState:
        if s.lora_slot >= 0 and (self.lora is None or s.lora_slot >= self.lora.num_slots):
            raise DeltaError(f"seq {s.seq_id} under LoRA slot {s.lora_slot}: this executor has "
                             f"{0 if self.lora is None else self.lora.num_slots} (--max-loras)", s.seq_id)
        tokens = s.tokens()
        state = SeqState(s.seq_id, tokens, s.num_prompt_tokens, array("i", s.block_ids), s.num_computed_tokens, s.sampling,
                         self._grammar_of(s.sampling, tokens[s.num_prompt_tokens:]), lora_slot=s.lora_slot)
        if s.sampling.prompt_logprobs >= 0 and len(tokens) == s.num_prompt_tokens > 1:
            state.prompt_lp_next = 1  # nothing sampled yet: its prompt is scored (again) from token 1
        return state

    def fork(self, p: SeqState, f: Fork) -> SeqState:
        sampling = p.sampling if f.seed is None else p.sampling.with_seed(f.seed)
        return SeqState(f.child_seq_id, list(p.token_ids), p.num_prompt_tokens, array("i", p.block_ids),
                        p.num_computed_tokens, sampling, p.grammar.fork() if p.grammar is not None else None,
                        lora_slot=p.lora_slot)

    def append_token(self, s: SeqState, seq_id: int, token: int) -> SeqState:
        s.token_ids.append(token)
        if s.grammar is not None:
            s.grammar.accept(token)
        return s

    def update_blocks(self, s: SeqState, u: BlockUpdate) -> SeqState:
        table = s.block_ids
        del table[u.start:]
        table.extend(u.block_ids)
        return s

    def _grammar_of(self, sampling: SamplingParams, outputs: list[int]) -> SeqGrammar | None:
        """A structured sequence's grammar state; it starts compiling now, while the sequence prefills.
        Beam rows have none: the fronts refuse the combination, and beams are chosen among unmasked
        candidates (so a grammar could fail only sampling rows, the ones the TP followers hear of)."""
        if sampling.structured is None or sampling.beam_candidates > 0:
            return None
        if self.grammar is None:
            return unserved("this executor has no tokenizer.json, so it cannot serve structured outputs")
        return self.grammar.track(sampling.structured, sampling.end_token_ids, outputs)
