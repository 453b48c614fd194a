"""A step's messages between the scheduler and its executors, each declared once: the plan
(``BatchPlan`` and its parts) and its answer (``StepResult`` and its parts), and the union of
every message the link carries. The link's own messages (handshake, heartbeat, drain, reset) are
in ``link_messages.py``; the field types and the message base, with how a declaration is the
schema, in ``schema.py``.

Plans are deltas (as in vLLM v1): a sequence's token ids, sampling parameters
and block table travel once per residency on an executor (``NewSeq``); after
that a step only names the sequence, how many tokens to compute and which block
ids were appended. The executor keeps per-sequence state and appends the tokens
it samples itself, so a decode step costs a few bytes per sequence.

Order in which an executor applies a :class:`BatchPlan` (both sides rely on it;
``plan_deltas.py`` applies steps 1-8, for every executor, real or simulated):

1. ``swap_out``   device block -> CPU block copies (data of preempted sequences)
2. ``free_seq_ids`` forget these sequences (finished, aborted or preempted);
   then ``lora_loads``, adapters into slots no sequence left uses
3. ``new_seqs``   register sequences (their full token ids and block tables)
4. ``forks``      child := copy of parent (tokens, block table, computed count)
5. ``append_tokens`` append scheduler-chosen tokens (beam search)
6. ``block_updates`` set ``table[index:] = block_ids`` for a sequence
7. ``swap_in``    CPU block -> device block copies
8. ``copies``     device block -> device block copies (copy-on-write)
9. forward ``scheduled`` sequences, in order; sample where a sequence's
   computed count reaches its token count, append the sample, report it;
   with ``decode_steps`` k > 1, run k such decode steps back to back, each
   computing the token the step before it sampled.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from pagedserve.wire import protocol as p
from pagedserve.wire.link_messages import Drain, Handshake, HandshakeReply, Heartbeat, Reset
from pagedserve.wire.packed import num_packed, unpacked
from pagedserve.wire.schema import (
    BlockIds,
    Count,
    Counts,
    Finite,
    Id,
    Ids,
    Name,
    NonNegative,
    PackedTokenIds,
    Pairs,
    Positive,
    Probability,
    Seed,
    Text,
    TopIds,
    TopValues,
    WireMessage,
)


class Structured(WireMessage):
    """A constraint on a sequence's output: ``kind`` is one of ``protocol.STRUCTURED_*``, which says
    what ``spec`` holds (a JSON schema, a regex, a JSON list of choices, a GBNF grammar). The
    executor compiles it (cached by spec) and masks every sampled token with it."""

    kind: Annotated[int, Meta(ge=min(p.STRUCTURED_KINDS), le=max(p.STRUCTURED_KINDS))]
    spec: Annotated[str, Meta(max_length=p.MAX_STRUCTURED_CHARS)]


class SamplingParams(WireMessage):
    """What an executor needs to turn logits into a token for one sequence.

    Request-level knobs (max_tokens, stop strings, n, beam width) stay in the
    scheduler. ``temperature == 0`` means greedy. ``seed`` makes the draw for
    output position j depend only on (seed, j): reproducible alone, in any
    batch, and after preemption or migration. ``beam_candidates > 0`` turns
    sampling off: the executor reports the top ``beam_candidates`` log-probs
    (log-softmax of the raw logits) and the scheduler chooses the token.
    ``logprobs`` is how many top alternatives to report besides the sampled
    token's own log-prob (reported when the request asked, ``want_logprobs``).

    The fields after ``beam_candidates`` came later and default to "off", so a
    sender may leave them out. ``logit_bias`` adds to the logits of those ids;
    ``min_tokens`` keeps ``end_token_ids`` (the ids that would end the sequence:
    its EOS ids unless it ignores EOS, and its stop token ids) from being sampled
    until it has that many output tokens. ``structured`` constrains every token to
    a grammar; it ends by sampling one of ``end_token_ids`` once the grammar has
    accepted its end. ``prompt_logprobs`` >= 0 asks the executor for the prompt
    tokens' log-probs (with that many alternatives each), computed while the prompt
    is prefilled. ``processed_logprobs``: report log-probs of the distribution the
    token is drawn from (after penalties, bias, grammar, temperature, truncation)
    instead of the model's raw log-softmax.
    """

    temperature: NonNegative = 1.0
    top_p: Annotated[float, Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Count = 0  # 0 = off
    min_p: Probability = 0.0
    seed: Seed | None = None
    repetition_penalty: Positive = 1.0  # HF: prompt + output
    presence_penalty: Finite = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: Finite = 0.0  # OpenAI semantics, over output tokens
    want_logprobs: bool = False
    logprobs: Annotated[int, Meta(ge=0, le=p.MAX_TOP_LOGPROBS)] = 0
    beam_candidates: Annotated[int, Meta(ge=0, le=p.MAX_TOP_LOGPROBS)] = 0
    logit_bias: Annotated[list[tuple[Id, Finite]], Meta(max_length=p.MAX_LOGIT_BIAS)] = \
        msgspec.field(default_factory=list)  # (token id, added to its logit)
    min_tokens: Count = 0
    end_token_ids: Annotated[list[Id], Meta(max_length=p.MAX_END_TOKEN_IDS)] = msgspec.field(default_factory=list)
    structured: Structured | None = None
    prompt_logprobs: Annotated[int, Meta(ge=-1, le=p.MAX_TOP_LOGPROBS)] = -1  # -1: none
    processed_logprobs: bool = False

    def with_seed(self, seed: int | None) -> SamplingParams:
        """The same parameters with another seed (every other field carried over)."""
        return msgspec.structs.replace(self, seed=seed)


class NewSeq(WireMessage):
    """A sequence's full state, sent once when it becomes resident.

    ``token_ids`` holds every known token (prompt, then outputs generated so far;
    after preemption or migration these are replayed), packed (:func:`pack_ids`;
    :meth:`tokens` unpacks them, and a length that is not a multiple of 4 is the
    receiver's to refuse). ``num_computed_tokens``
    tokens already have K/V in the cache (prefix-cache hit or swapped-in
    blocks); ``block_ids`` is the whole block table. ``lora_slot``: the executor's LoRA slot whose
    adapter the sequence runs under (-1: the base model); a fork inherits its parent's.
    """

    seq_id: Id
    token_ids: PackedTokenIds
    num_prompt_tokens: Count
    block_ids: BlockIds
    num_computed_tokens: Count
    sampling: SamplingParams
    lora_slot: Annotated[int, Meta(ge=-1, le=p.MAX_LORA_SLOTS - 1)] = -1

    @property
    def num_tokens(self) -> int:
        """How many tokens ``token_ids`` holds; WireError unless a whole number of them."""
        return num_packed(self.token_ids)

    def tokens(self) -> list[int]:
        """``token_ids`` as ints; WireError as :attr:`num_tokens`."""
        return unpacked(self.token_ids).tolist()


class Fork(WireMessage):
    """Child becomes a copy of parent (tokens, block table, computed count).

    ``seed`` replaces the child's sampling seed (parallel sampling gives
    choice i the seed ``seed + i``); ``None`` keeps the parent's.
    """

    parent_seq_id: Id
    child_seq_id: Id
    seed: Seed | None = None


class BlockUpdate(WireMessage):
    """Set ``block_table[start:] = block_ids`` for one sequence.

    Appending a block is ``start == len(table)``; a copy-on-write replacement
    of the last block is ``start == len(table) - 1``.
    """

    seq_id: Id
    start: Count
    block_ids: BlockIds


class Proposal(WireMessage):
    """Speculative decoding: tokens proposed to follow a decoding sequence's last token. The
    executor scores the last token and these in one forward and reports the tokens the target
    model emits (``StepResult.spec_tokens``): the proposals it accepts, then its own next token."""

    seq_id: Id
    token_ids: Annotated[list[Id], Meta(min_length=1, max_length=p.MAX_SPECULATIVE_TOKENS)]


class DraftProposal(WireMessage):
    """Speculative decoding by a draft model: the executor's draft proposes ``num_tokens`` tokens to
    follow a decoding sequence's last token, in the step that verifies them (as a :class:`Proposal`
    the scheduler would have sent); the sequence's table holds their slots."""

    seq_id: Id
    num_tokens: Annotated[int, Meta(ge=1, le=p.MAX_SPECULATIVE_TOKENS)]


class LoraLoad(WireMessage):
    """Load the PEFT adapter at ``path`` into LoRA slot ``slot`` (replacing what it held: no
    sequence the executor holds uses that slot), before the plan's step runs."""

    slot: Annotated[int, Meta(ge=0, le=p.MAX_LORA_SLOTS - 1)]
    name: Name
    path: Annotated[str, Meta(min_length=1, max_length=p.MAX_LORA_PATH_CHARS)]


class LoraFailure(WireMessage):
    """A :class:`LoraLoad` the executor could not carry out: the slot holds no adapter now."""

    slot: Annotated[int, Meta(ge=0, le=p.MAX_LORA_SLOTS - 1)]
    reason: Text


class SeqRejection(WireMessage):
    """A sequence failed for what its request asked, not for anything the executor did: its grammar
    does not compile on the executor's engine, or the executor serves no structured outputs. The
    reason goes to that request's client alone."""

    seq_id: Count
    reason: Annotated[str, Meta(max_length=p.MAX_REJECTION_CHARS)]


class BatchPlan(WireMessage):
    """One iteration for one executor. See the module docstring for the order.

    ``scheduled_seq_ids[i]`` computes ``num_new_tokens[i]`` tokens starting
    at its current computed count. A sequence in ``new_seqs`` that is not in
    ``scheduled_seq_ids`` is registered but idle this step.

    ``decode_steps`` k > 1 (at most the executor's ``Handshake.max_decode_steps``):
    every scheduled sequence decodes (one new token, and it samples) k times
    in a row, each step's input the token the step before sampled, so one plan
    and one result carry k tokens per sequence. Only for plain sampling
    sequences (no beam candidates, log-probs or structured output), whose block
    tables already hold the k slots; nothing else in the plan but frees and
    block updates. The result reports the k steps one after another, each in
    plan order.

    ``proposals``: speculative decoding (to executors whose handshake says ``speculative``): a
    sequence listed there decodes (one new token, and it samples) and the executor scores its
    proposals in the same forward; its table holds their slots. Never in a plan of several decode
    steps. ``draft_proposals``: the same, the proposals made by the executor's draft model (to
    executors whose handshake names a ``draft_model``); a sequence is in one of the two lists at most.

    ``lora_loads``: adapters to load, in order, after the frees (to executors whose handshake has
    ``lora_slots``).
    """

    step_id: Count
    scheduled_seq_ids: Ids = msgspec.field(default_factory=list)
    num_new_tokens: Counts = msgspec.field(default_factory=list)
    new_seqs: Annotated[list[NewSeq], Meta(max_length=p.MAX_SEQS_PER_STEP)] = msgspec.field(default_factory=list)
    free_seq_ids: Ids = msgspec.field(default_factory=list)
    forks: Annotated[list[Fork], Meta(max_length=p.MAX_SEQS_PER_STEP)] = msgspec.field(default_factory=list)
    append_tokens: Pairs = msgspec.field(default_factory=list)  # (seq_id, token_id)
    block_updates: Annotated[list[BlockUpdate], Meta(max_length=p.MAX_SEQS_PER_STEP)] = \
        msgspec.field(default_factory=list)
    swap_out: Pairs = msgspec.field(default_factory=list)  # (device_block, cpu_block)
    swap_in: Pairs = msgspec.field(default_factory=list)  # (cpu_block, device_block)
    copies: Pairs = msgspec.field(default_factory=list)  # (src_block, dst_block)
    decode_steps: Annotated[int, Meta(ge=1, le=p.MAX_DECODE_STEPS)] = 1
    proposals: Annotated[list[Proposal], Meta(max_length=p.MAX_SEQS_PER_STEP)] = msgspec.field(default_factory=list)
    lora_loads: Annotated[list[LoraLoad], Meta(max_length=p.MAX_LORA_SLOTS)] = msgspec.field(default_factory=list)
    draft_proposals: Annotated[list[DraftProposal], Meta(max_length=p.MAX_SEQS_PER_STEP)] = \
        msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.scheduled_seq_ids) != len(self.num_new_tokens):
            raise ValueError("scheduled_seq_ids and num_new_tokens differ in length")


class SeqLogprobs(WireMessage):
    """Log-probs for one sampled token: its own and the top alternatives."""

    seq_id: Id
    token_logprob: float
    top_token_ids: TopIds
    top_logprobs: TopValues

    def __post_init__(self) -> None:
        if len(self.top_token_ids) != len(self.top_logprobs):
            raise ValueError("top_token_ids and top_logprobs differ in length")


class SpecTokens(WireMessage):
    """Tokens a speculating sequence emitted after its first one (which is in ``sampled_token_ids``),
    in order, with their log-probs when the sequence asks for them (one entry per token)."""

    seq_id: Id
    token_ids: Annotated[list[Id], Meta(max_length=p.MAX_SPECULATIVE_TOKENS)]
    logprobs: Annotated[list[SeqLogprobs], Meta(max_length=p.MAX_SPECULATIVE_TOKENS)] = \
        msgspec.field(default_factory=list)


class PromptLogprobs(WireMessage):
    """Prompt tokens a step scored for one sequence (``SamplingParams.prompt_logprobs``): tokens
    ``start .. start + len(token_logprobs) - 1`` of its prompt, each token's log-prob given the
    tokens before it, and each position's top alternatives, ``top_token_ids`` / ``top_logprobs``
    holding the same number per token, back to back; ``token_ranks``: each token's rank in the
    vocabulary at its position (1 + the log-probs above its own; empty from an executor that
    predates the field). A sequence registered again (preemption, migration) is scored again from
    token 1."""

    seq_id: Id
    start: Annotated[int, Meta(ge=1, le=p.MAX_SEQ_TOKENS)]
    token_logprobs: Annotated[list[float], Meta(max_length=p.MAX_SEQ_TOKENS)]
    top_token_ids: Annotated[list[Id], Meta(max_length=p.MAX_PROMPT_LOGPROB_ENTRIES)]
    top_logprobs: Annotated[list[float], Meta(max_length=p.MAX_PROMPT_LOGPROB_ENTRIES)]
    token_ranks: Annotated[list[Annotated[int, Meta(ge=1, le=p.MAX_INT32)]], Meta(max_length=p.MAX_SEQ_TOKENS)] = \
        msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.top_token_ids) != len(self.top_logprobs):
            raise ValueError("top_token_ids and top_logprobs differ in length")
        if self.token_ranks and len(self.token_ranks) != len(self.token_logprobs):
            raise ValueError("token_ranks and token_logprobs differ in length")


class StepResult(WireMessage):
    """What the executor did with one plan: the one answer every plan gets, in plan order.

    Three outcomes, each with one handling on the scheduler (docs/ARCHITECTURE.md,
    "Failure kinds"):

    * **served**: ``sampled_seq_ids[i]`` got token ``sampled_token_ids[i]`` (only
      sequences whose computed count reached their token count sample, in plan
      order; a plan of ``decode_steps`` k lists its sequences k times, a step
      after another). Beam sequences instead appear in ``beam_candidates`` as (seq_id,
      token ids, log-probs), best first, and do not append anything themselves.
    * **some sequences failed** (``failed_seq_ids`` not empty, ``refused`` false): the
      plan was applied, but the step could not serve these sequences (a forward or
      sampler error). The executor has dropped them; the other sequences were served
      as above. Plans sent after this one may still name a dropped sequence: the
      executor skips every entry that does (a fork from it drops the child too) until
      a plan frees it. The scheduler fails the requests that own them. ``error`` is
      the detail, for logs only.
    * **refused** (``refused`` true): nothing of the plan was applied: it does not fit
      the executor's sequence state, so the two views have parted. The executor
      refuses every later plan the same way, applying nothing, until a :class:`Reset`.
      ``failed_seq_ids`` names the sequences the check found at fault, when it could
      tell. ``error`` says why.

    ``rejected`` names the failed sequences whose own request is at fault (a grammar the
    executor's engine refuses), each with the reason its client is told: the scheduler fails
    those requests as invalid and does not hold the step against the executor. (An executor
    older than the field sends none: its rejections count as failures, as they did.)

    Anything else (a step id not sent, another order or set of sequences, a token id
    outside the vocabulary, more log-probs than asked for) breaks the contract: the
    scheduler drops the executor before any of the result is applied.
    """

    step_id: Count
    sampled_seq_ids: Ids = msgspec.field(default_factory=list)
    sampled_token_ids: Ids = msgspec.field(default_factory=list)
    logprobs: Annotated[list[SeqLogprobs], Meta(max_length=p.MAX_SEQS_PER_STEP)] = \
        msgspec.field(default_factory=list)
    beam_candidates: Annotated[list[SeqLogprobs], Meta(max_length=p.MAX_SEQS_PER_STEP)] = \
        msgspec.field(default_factory=list)  # token_logprob unused (0.0)
    failed_seq_ids: Ids = msgspec.field(default_factory=list)
    refused: bool = False
    error: Text | None = None
    model_seconds: NonNegative = 0.0
    # The prompt tokens this step scored for the sequences that asked (a sequence's whole prompt, over
    # the steps that prefill it; a step's computed tokens bound it).
    prompt_logprobs: Annotated[list[PromptLogprobs], Meta(max_length=p.MAX_SEQS_PER_STEP)] = \
        msgspec.field(default_factory=list)
    # The tokens speculating sequences (BatchPlan.proposals) emitted after their first, in plan order.
    spec_tokens: Annotated[list[SpecTokens], Meta(max_length=p.MAX_SEQS_PER_STEP)] = msgspec.field(default_factory=list)
    # The plan's LoRA loads that failed; the sequences that run under those slots are in failed_seq_ids.
    lora_failures: Annotated[list[LoraFailure], Meta(max_length=p.MAX_LORA_SLOTS)] = \
        msgspec.field(default_factory=list)
    rejected: Annotated[list[SeqRejection], Meta(max_length=p.MAX_SEQS_PER_STEP)] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.sampled_seq_ids) != len(self.sampled_token_ids):
            raise ValueError("sampled_seq_ids and sampled_token_ids differ in length")
        if self.rejected and not {r.seq_id for r in self.rejected} <= set(self.failed_seq_ids):
            raise ValueError("rejected names sequences that are not in failed_seq_ids")


Message = Handshake | HandshakeReply | Heartbeat | BatchPlan | StepResult | Drain | Reset

KIND_OF: dict[type, int] = {
    Handshake: p.KIND_HANDSHAKE, HandshakeReply: p.KIND_HANDSHAKE_REPLY, Heartbeat: p.KIND_HEARTBEAT,
    BatchPlan: p.KIND_PLAN, StepResult: p.KIND_RESULT, Drain: p.KIND_DRAIN, Reset: p.KIND_RESET,
}
