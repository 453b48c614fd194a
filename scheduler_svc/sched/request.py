"""Requests, their sequences, and what the scheduler reports back per step.

One token-count model (no prefill flag): a :class:`Sequence` holds every token
it knows (prompt, then outputs) and ``num_computed_tokens`` — how many of them
have K/V in the cache or in a plan already sent. Scheduling a sequence means
computing the next ``num_new_tokens`` of them; it samples a token when the count
catches up with ``num_tokens``. Prefill, chunked prefill, decode and recompute
after preemption are all the same thing.

With asynchronous scheduling a plan is built while the previous one still runs:
a token sampled in a step still in flight is a *placeholder* (``num_placeholders``)
that already counts in ``num_tokens``, so the next step can compute it (the
executor knows its value: it appended its own sample) before the scheduler does.

A :class:`Request` owns 1..n sequences: n choices of parallel sampling, or the
live beams of beam search. Its sequences are scheduled, preempted and swapped
together.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedserve.engine_api import FinishReason, GenerationRequest
from pagedserve.wire import SamplingParams, pack_ids


class RequestState(enum.IntEnum):
    WAITING = 0  # no blocks (new, or preempted by recompute)
    RUNNING = 1  # blocks on the device
    SWAPPED = 2  # blocks in the CPU pool
    FINISHED = 3


@dataclass(slots=True, eq=False)
class Sequence:
    """One stream of tokens with its own block table (kept by the KV manager)."""

    seq_id: int  # unique within one scheduler; the executor's key
    index: int  # choice index in the request (beam search: slot, not rank)
    token_ids: list[int]  # prompt + outputs
    num_prompt_tokens: int
    sampling: SamplingParams
    request: Request
    num_computed_tokens: int = 0
    finish_reason: FinishReason | None = None
    cum_logprob: float = 0.0  # beam search score (sum of chosen tokens' log-probs)
    resident: bool = False  # the executor holds this sequence's state
    fork_parent: int | None = None  # a Fork from this seq id is owed to the executor
    fork_seed: int | None = None
    owed_tokens: list[int] = field(default_factory=list)  # owed as append_tokens (beams)
    num_placeholders: int = 0  # samples of steps still in flight (placeholders at the end of token_ids)
    residency: int = 0  # bumped when its blocks are released: a late commit must not touch new ones

    @property
    def num_tokens(self) -> int:
        """Known tokens plus placeholders for samples in flight."""
        return len(self.token_ids) + self.num_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def forget_executor_state(self) -> None:
        """The executor dropped this sequence (preemption): what was owed is moot."""
        self.resident = False
        self.fork_parent = None
        self.fork_seed = None
        self.owed_tokens.clear()


@dataclass(slots=True)
class BeamHypothesis:
    score: float  # cumulative log-prob / generated_len ** length_penalty
    output_token_ids: list[int]
    finish_reason: FinishReason


@dataclass(slots=True)
class BeamState:
    """HF-style beam bookkeeping; finished hypotheses hold no blocks."""

    width: int
    finished: list[BeamHypothesis] = field(default_factory=list)  # best first, at most width
    improvable: bool = True  # HF's is_early_stop_heuristic_unsatisfied


@dataclass(slots=True, eq=False)
class Request:
    """A request as the scheduler tracks it."""

    req: GenerationRequest
    arrival: int  # order of arrival at this scheduler; preemption victim = largest
    seqs: list[Sequence] = field(default_factory=list)  # every sequence, live or finished
    live: list[Sequence] = field(default_factory=list)  # unfinished ones, in index order
    state: RequestState = RequestState.WAITING
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at first admission (usage)
    spec_proposed: int = 0  # speculative decoding: tokens proposed to its sequences (usage)
    spec_accepted: int = 0  # of those, accepted
    forked: bool = True  # False while an n > 1 request still prefills its one shared prompt
    beam: BeamState | None = None
    emitted_seqs: int = 0  # seqs already reported finished (so "finished" is sent once)
    # Stop rules, resolved once at arrival (read per sampled token).
    eos_token_ids: frozenset[int] = frozenset()  # empty when ignore_eos
    stop_token_ids: frozenset[int] = frozenset()
    stop_len: int = 0  # a sequence of this many tokens is done: min(prompt + max_tokens, max_model_len)
    lora_slot: int | None = None  # the LoRA slot it pins while admitted (lora_slots.py); None: none
    packed_prompt_ids: bytes | None = None  # (packed_tokens(): built at its first NewSeq, kept for re-sends)

    @property
    def request_id(self) -> str:
        return self.req.request_id

    def packed_tokens(self, seq: Sequence) -> bytes:
        """``seq``'s tokens as a NewSeq carries them (packed uint32s): the prompt is packed once per
        request, since every sequence of it and every re-send after preemption or migration has it."""
        if self.packed_prompt_ids is None:
            self.packed_prompt_ids = pack_ids(self.req.prompt_token_ids)
        outputs = seq.output_token_ids
        return self.packed_prompt_ids + pack_ids(outputs) if outputs else self.packed_prompt_ids

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.req.prompt_token_ids)



@dataclass(slots=True)
class MigratedRequest:
    """Everything needed to re-queue a request on another scheduler.

    ``outputs[i]`` / ``finish_reasons[i]`` are choice i's tokens so far and
    whether it already finished. Beam search restarts from scratch (its
    finished hypotheses are not resumable), so both lists are empty for it.
    """

    request: GenerationRequest
    outputs: list[list[int]]
    finish_reasons: list[FinishReason | None]
