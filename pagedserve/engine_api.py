"""Types at the edge between the gRPC layer and the engine.

The servicer validates a client's request into a :class:`GenerationRequest`
(every field checked, limits applied) and the engine streams
:class:`RequestOutput` deltas back. Nothing here knows about protobuf or blocks.

The per-token messages (:class:`ChoiceDelta`, :class:`RequestOutput`, :class:`TokenLogprob`,
:class:`Usage`) are msgspec Structs: several are built per running request per step, a Struct
is built in C at a fifth of a dataclass ``__init__``'s cost, and ``gc=False`` (they never form
reference cycles) keeps them out of the collector's generations.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Annotated, Protocol

import msgspec
from msgspec import Meta

from pagedserve.kv_blocks import BLOCK_HASH_BYTES, MAX_CACHE_SALT_CHARS
from pagedserve.lora_modules import MAX_NAME_CHARS as MAX_LORA_NAME_CHARS
from pagedserve.wire import SamplingParams
from pagedserve.wire import protocol as p

# What a front may send in a Submit (checked when the engine core decodes one, never on construction;
# a front's limits stay within them, and the core then holds a request to its own limits:
# pagedserve/request_bounds.py). A request's tokens are a sequence's at most; so are its blocks' hashes.
RequestId = Annotated[str, Meta(min_length=1, max_length=p.MAX_REQUEST_ID_CHARS)]
TokenId = Annotated[int, Meta(ge=0, le=p.MAX_INT32)]
MaxTokens = Annotated[int, Meta(ge=1, le=p.MAX_SEQ_TOKENS)]
Choices = Annotated[int, Meta(ge=1, le=p.MAX_CHOICES)]
BeamWidth = Annotated[int, Meta(ge=1, le=p.MAX_TOP_LOGPROBS // 2)]  # (each beam asks for 2 x beam_width candidates)
LengthPenalty = Annotated[float, Meta(ge=-p.MAX_LENGTH_PENALTY, le=p.MAX_LENGTH_PENALTY)]
StopStrings = Annotated[list[Annotated[str, Meta(min_length=1, max_length=p.MAX_STOP_STRING_CHARS)]],
                        Meta(max_length=p.MAX_STOP_STRINGS)]
StopTokenIds = Annotated[list[TokenId], Meta(max_length=p.MAX_END_TOKEN_IDS)]
BlockHashes = Annotated[list[Annotated[bytes, Meta(min_length=BLOCK_HASH_BYTES, max_length=BLOCK_HASH_BYTES)]],
                        Meta(max_length=p.MAX_SEQ_TOKENS)]
LoraName = Annotated[str, Meta(max_length=MAX_LORA_NAME_CHARS)]
CacheSalt = Annotated[str, Meta(min_length=1, max_length=MAX_CACHE_SALT_CHARS)]


class FinishReason(enum.IntEnum):
    # Values match pagedserve.v1.FinishReason so the servicer maps them 1:1.
    UNSPECIFIED = 0
    LENGTH = 1
    STOP = 2
    EOS = 3
    ABORTED = 4


@dataclass(slots=True)
class RequestParams:
    """A request's generation settings, already validated.

    ``sampling`` is the per-sequence template sent to executors; with n > 1,
    choice i samples with seed ``sampling.seed + i`` (when a seed is given).
    """

    max_tokens: MaxTokens
    sampling: SamplingParams = field(default_factory=SamplingParams)
    n: Choices = 1
    beam_width: BeamWidth = 1  # > 1: beam search (deterministic, sampling ignored)
    length_penalty: LengthPenalty = 1.0
    early_stopping: bool = False
    stop: StopStrings = field(default_factory=list)
    stop_token_ids: StopTokenIds = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False  # a matched stop string stays in the text (vLLM's extension)
    skip_special_tokens: bool = True  # special tokens are left out of the text (False: Mistral's tool calls)


@dataclass(slots=True)
class GenerationRequest:
    request_id: RequestId
    prompt_token_ids: Annotated[list[int], Meta(max_length=0)]  # (on the front link: empty, the Submit packs them)
    params: RequestParams
    arrival_time: float = 0.0  # time.monotonic() at the API edge (the engine stamps it if unset)
    deadline: float | None = None  # time.monotonic() after which the engine core ends it (ErrorKind.DEADLINE)
    first_scheduled_at: float | None = None  # set once, by the first scheduler that admits it
    # The prompt's full-block hash chain (kv_cache_manager.hash_blocks, unsalted): computed once,
    # by the engine for routing, and reused by every scheduler that admits the request.
    prompt_block_hashes: BlockHashes | None = None
    # The most tokens (prompt and outputs) it may reach: min(prompt + max_tokens, the longest context
    # of an executor that could take it), fixed by the engine when it is first placed. Every executor
    # it runs on, after a migration too, must hold that many, so where it runs never changes where it
    # ends. None: the scheduler's own max_model_len bounds it (tests driving one scheduler).
    max_total_tokens: int | None = None
    # The LoRA adapter it runs under (--lora-modules, or loaded at run time); None: the base model.
    # lora_id: which load of that name (set by the engine core; 0: an adapter given at start).
    lora: LoraName | None = None
    lora_id: int = 0
    # vLLM's cache_salt: the prefix cache shares blocks only among requests of the same salt (it
    # roots the block hash chain: kv_blocks.chain_root).
    cache_salt: CacheSalt | None = None


class TokenLogprob(msgspec.Struct, gc=False):
    token_id: int
    logprob: float
    top_token_ids: list[int] = msgspec.field(default_factory=list)
    top_logprobs: list[float] = msgspec.field(default_factory=list)
    rank: int | None = None  # a prompt token's rank in the vocabulary (1 + the tokens more likely), when known


class PromptScores(msgspec.Struct, array_like=True, gc=False):
    """Prompt tokens ``start ..`` of a request scored by one step (its prompt log-probs, in pieces as
    its prompt is prefilled); a piece starting at 1 begins the prompt again (it was registered again)."""

    start: int
    logprobs: list[TokenLogprob]


class ChoiceDelta(msgspec.Struct, gc=False):
    """What advanced for one choice since the last message."""

    index: int
    text: str = ""
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprob] = msgspec.field(default_factory=list)
    finish_reason: FinishReason = FinishReason.UNSPECIFIED
    # What ended it by STOP, as vLLM's stop_reason: the stop string matched, or the stop token id
    # (None for EOS, a length, or while it runs).
    stop_reason: str | int | None = None


class Usage(msgspec.Struct, gc=False):
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    # Speculative decoding, when the request was speculated (0 otherwise): tokens proposed to it
    # and, of those, accepted by the target model.
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0


class RequestOutput(msgspec.Struct, gc=False):
    request_id: str
    choices: list[ChoiceDelta]
    usage: Usage | None = None  # set on the last message only
    finished: bool = False
    # When the request asked for them (SamplingParams.prompt_logprobs): one entry per prompt token,
    # None for the first (nothing precedes it); on the first message only.
    prompt_logprobs: list[TokenLogprob | None] | None = None


class ErrorKind(enum.IntEnum):
    """Why the engine ended a request in error: the one form its error has from the engine core to
    the client. It travels on the request's last update (``RequestUpdate.error_kind``: these ints on
    the tier link) or in an :class:`EngineError`, and scheduler_svc/front/output/status_codes.py maps
    it to the client's gRPC status, HTTP status and OpenAI error code."""

    FAILED = 0  # an internal failure of this request only (INTERNAL)
    NO_EXECUTOR = 1  # no executor can take it now, or it ran out of migrations (UNAVAILABLE)
    QUEUE_FULL = 2  # more requests queued than the configured limit (RESOURCE_EXHAUSTED)
    NOT_FOUND = 3  # it names a LoRA adapter this deployment does not serve (NOT_FOUND, 404)
    INVALID = 4  # what it asked for cannot be served as asked: an executor refused its grammar (INVALID_ARGUMENT, 400)
    DEADLINE = 5  # its client's deadline passed before it ended (DEADLINE_EXCEEDED, 408)


class EngineError(Exception):
    """The engine ends a request in error: its :class:`ErrorKind` and a message for its client."""

    def __init__(self, kind: ErrorKind, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(slots=True)
class ModelInfo:
    """What the servicer needs to validate requests and answer GetModelInfo."""

    model_name: str
    architecture: str
    max_model_len: int
    vocab_size: int
    block_size: int
    num_executors: int
    eos_token_ids: tuple[int, ...] = ()  # every end-of-sequence id, first = config.json's first
    max_request_blocks: int = 0  # KV blocks one request may hold on the roomiest executor (0: unchecked)
    max_token_chars: int = 0  # characters the longest vocabulary entry spans (0: unchecked)
    lora_adapters: tuple[str, ...] = ()  # the LoRA adapters a request may name in its `model` field


@dataclass(slots=True)
class ExecutorStats:
    id: str
    state: str  # "ready" | "draining" | "dead"
    kv_blocks_total: int
    kv_blocks_used: int  # held by live sequences
    kv_blocks_cached: int  # free but still holding prefix-cache content
    kv_blocks_shared: int  # held with refcount > 1 (parallel sampling / beam search)
    cpu_blocks_total: int
    cpu_blocks_used: int
    num_running: int = 0
    num_waiting: int = 0
    tensor_parallel_size: int = 1  # ranks behind this one executor (from its handshake)


@dataclass(slots=True)
class EngineStats:
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    num_preemptions: int = 0
    prefix_cache_query_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    num_migrations: int = 0
    executors: list[ExecutorStats] = field(default_factory=list)
    # Speculative decoding (vLLM's spec_decode counters): proposal rounds, tokens proposed, accepted,
    # and accepted by position in the round.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # LoRA (vLLM's lora_requests_info): the adapters of running and of waiting requests, and the most
    # adapters one executor computes in a step.
    lora_running: list[str] = field(default_factory=list)
    lora_waiting: list[str] = field(default_factory=list)
    max_lora: int = 0


class EngineApi(Protocol):
    """All the servicer and the HTTP front see of the engine (docs/ARCHITECTURE.md, "Engine <->
    servicer"): a front's ``FrontStreams``, or the in-process ``Engine`` of tests and benchmarks."""

    def model_info(self) -> ModelInfo | None: ...
    def is_ready(self) -> bool: ...
    def health_problem(self) -> str | None: ...
    async def current_stats(self) -> EngineStats: ...  # (stats() may be a heartbeat old in a front)
    def stats(self) -> EngineStats: ...
    def generate(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]: ...


class SeqUpdate(msgspec.Struct, array_like=True, gc=False):  # built per token; positional on the tier link
    """New tokens of one choice since the last update.

    Beam search reports nothing while it runs; its final update holds
    ``beam_width`` choices, best first (``index`` = rank), each with its whole
    output (``new_token_ids``). Token ids include a final EOS/stop token.
    """

    index: int
    new_token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None


class RequestUpdate(msgspec.Struct, array_like=True, gc=False):  # built per token; a front gets them positional
    request_id: str
    seqs: list[SeqUpdate]
    finished: bool = False
    prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    error: str | None = None  # set when it failed (a generic message: details are logged); it is freed
    error_kind: ErrorKind = ErrorKind.FAILED  # with error: what the client is told
    prompt_logprobs: PromptScores | None = None  # prompt tokens a step scored (the request asked)
    # Speculative decoding: the request's totals so far (tokens proposed, accepted), on each update of
    # a step that verified its proposals; 0 when none (the front keeps the latest for the usage).
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0
