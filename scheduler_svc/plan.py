"""The wire contract between the scheduler and its executors.

Every message is one msgpack array ``[WIRE_VERSION, KIND, *fields]``. Each
dataclass below maps to and from a plain list (never pickle, never maps with
string keys: field order *is* the schema, so a change of order or meaning bumps
``WIRE_VERSION``). Decoding validates every field's type and raises
:class:`WireError` (a ``ValueError``) on anything malformed; callers log and
drop such a frame, they never crash on it.

Plans are deltas (as in vLLM v1): a sequence's token ids, sampling parameters
and block table travel once per residency on an executor (``NewSeq``); after
that a step only names the sequence, how many tokens to compute and which block
ids were appended. The executor keeps per-sequence state and appends the tokens
it samples itself, so a decode step costs a few bytes per sequence.

Order in which an executor applies a :class:`BatchPlan` (documented here because
both sides rely on it):

1. ``swap_out``   device block -> CPU block copies (data of preempted sequences)
2. ``free_seq_ids`` forget these sequences (finished, aborted or preempted)
3. ``new_seqs``   register sequences (their full token ids and block tables)
4. ``forks``      child := copy of parent (tokens, block table, computed count)
5. ``append_tokens`` append scheduler-chosen tokens (beam search)
6. ``block_updates`` set ``table[index:] = block_ids`` for a sequence
7. ``swap_in``    CPU block -> device block copies
8. ``copies``     device block -> device block copies (copy-on-write)
9. forward ``scheduled`` sequences, in order; sample where a sequence's
   computed count reaches its token count, append the sample, report it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack

from scheduler_svc.wire_fields import (
    WireError,
    as_bool,
    as_float,
    as_int,
    as_ints,
    as_list,
    as_opt_int,
    as_pairs,
    as_str,
    flat_pairs,
)

WIRE_VERSION = 1

# Hard bounds on what we accept from a peer (decoding is the trust boundary).
MAX_FRAME_BYTES = 64 * 1024 * 1024
_MAX_ARRAY_LEN = 4 * 1024 * 1024

# Message kinds (second element of every frame).
KIND_HANDSHAKE = 1
KIND_HANDSHAKE_REPLY = 2
KIND_HEARTBEAT = 3
KIND_PLAN = 4
KIND_RESULT = 5
KIND_DRAIN = 6


# --------------------------------------------------------------------------
# messages


@dataclass(slots=True)
class SamplingParams:
    """What an executor needs to turn logits into a token for one sequence.

    Request-level knobs (max_tokens, stop strings, n, beam width) stay in the
    scheduler. ``temperature == 0`` means greedy. ``seed`` makes the draw for
    output position j depend only on (seed, j): reproducible alone, in any
    batch, and after preemption or migration. ``beam_candidates > 0`` turns
    sampling off: the executor reports the top ``beam_candidates`` log-probs
    (log-softmax of the raw logits) and the scheduler chooses the token.
    ``logprobs`` is how many top alternatives to report besides the sampled
    token's own log-prob (which is reported whenever ``logprobs >= 0`` and the
    request asked for logprobs, signalled by ``want_logprobs``).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0  # HF semantics, over prompt + output
    presence_penalty: float = 0.0  # OpenAI semantics, over output tokens
    frequency_penalty: float = 0.0  # OpenAI semantics, over output tokens
    want_logprobs: bool = False
    logprobs: int = 0
    beam_candidates: int = 0

    def to_wire(self) -> list:
        return [
            self.temperature, self.top_p, self.top_k, self.min_p, self.seed,
            self.repetition_penalty, self.presence_penalty, self.frequency_penalty,
            self.want_logprobs, self.logprobs, self.beam_candidates,
        ]

    @classmethod
    def from_wire(cls, v: Any) -> SamplingParams:
        v = as_list(v, "sampling", 11)
        return cls(
            as_float(v[0], "temperature"), as_float(v[1], "top_p"), as_int(v[2], "top_k"),
            as_float(v[3], "min_p"), as_opt_int(v[4], "seed"),
            as_float(v[5], "repetition_penalty"), as_float(v[6], "presence_penalty"),
            as_float(v[7], "frequency_penalty"), as_bool(v[8], "want_logprobs"),
            as_int(v[9], "logprobs"), as_int(v[10], "beam_candidates"),
        )


@dataclass(slots=True)
class NewSeq:
    """A sequence's full state, sent once when it becomes resident.

    ``token_ids`` holds every known token (prompt, then outputs generated so far
    — after preemption or migration these are replayed). ``num_computed_tokens``
    tokens already have K/V in the cache (prefix-cache hit or swapped-in
    blocks); ``block_ids`` is the whole block table.
    """

    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams

    def to_wire(self) -> list:
        return [self.seq_id, self.token_ids, self.num_prompt_tokens, self.block_ids,
                self.num_computed_tokens, self.sampling.to_wire()]

    @classmethod
    def from_wire(cls, v: Any) -> NewSeq:
        v = as_list(v, "new_seq", 6)
        return cls(as_int(v[0], "seq_id"), as_ints(v[1], "token_ids"), as_int(v[2], "num_prompt_tokens"),
                   as_ints(v[3], "block_ids"), as_int(v[4], "num_computed_tokens"),
                   SamplingParams.from_wire(v[5]))


@dataclass(slots=True)
class Fork:
    """Child becomes a copy of parent (tokens, block table, computed count).

    ``seed`` replaces the child's sampling seed (parallel sampling gives
    choice i the seed ``seed + i``); ``None`` keeps the parent's.
    """

    parent_seq_id: int
    child_seq_id: int
    seed: int | None = None

    def to_wire(self) -> list:
        return [self.parent_seq_id, self.child_seq_id, self.seed]

    @classmethod
    def from_wire(cls, v: Any) -> Fork:
        v = as_list(v, "fork", 3)
        return cls(as_int(v[0], "parent_seq_id"), as_int(v[1], "child_seq_id"), as_opt_int(v[2], "seed"))


@dataclass(slots=True)
class BlockUpdate:
    """Set ``block_table[start:] = block_ids`` for one sequence.

    Appending a block is ``start == len(table)``; a copy-on-write replacement
    of the last block is ``start == len(table) - 1``.
    """

    seq_id: int
    start: int
    block_ids: list[int]

    def to_wire(self) -> list:
        return [self.seq_id, self.start, self.block_ids]

    @classmethod
    def from_wire(cls, v: Any) -> BlockUpdate:
        v = as_list(v, "block_update", 3)
        return cls(as_int(v[0], "seq_id"), as_int(v[1], "start"), as_ints(v[2], "block_ids"))


@dataclass(slots=True)
class BatchPlan:
    """One iteration for one executor. See the module docstring for order.

    ``scheduled_seq_ids[i]`` computes ``num_new_tokens[i]`` tokens starting
    at its current computed count. A sequence in ``new_seqs`` that is not in
    ``scheduled_seq_ids`` is registered but idle this step.
    """

    step_id: int
    scheduled_seq_ids: list[int] = field(default_factory=list)
    num_new_tokens: list[int] = field(default_factory=list)
    new_seqs: list[NewSeq] = field(default_factory=list)
    free_seq_ids: list[int] = field(default_factory=list)
    forks: list[Fork] = field(default_factory=list)
    append_tokens: list[tuple[int, int]] = field(default_factory=list)  # (seq_id, token_id)
    block_updates: list[BlockUpdate] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device_block, cpu_block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu_block, device_block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src_block, dst_block)

    def to_wire(self) -> list:
        return [
            self.step_id, self.scheduled_seq_ids, self.num_new_tokens,
            [s.to_wire() for s in self.new_seqs], self.free_seq_ids,
            [f.to_wire() for f in self.forks], flat_pairs(self.append_tokens),
            [u.to_wire() for u in self.block_updates], flat_pairs(self.swap_out),
            flat_pairs(self.swap_in), flat_pairs(self.copies),
        ]

    @classmethod
    def from_wire(cls, v: Any) -> BatchPlan:
        v = as_list(v, "plan", 11)
        plan = cls(
            as_int(v[0], "step_id"), as_ints(v[1], "scheduled_seq_ids"), as_ints(v[2], "num_new_tokens"),
            [NewSeq.from_wire(x) for x in as_list(v[3], "new_seqs")], as_ints(v[4], "free_seq_ids"),
            [Fork.from_wire(x) for x in as_list(v[5], "forks")], as_pairs(v[6], "append_tokens"),
            [BlockUpdate.from_wire(x) for x in as_list(v[7], "block_updates")],
            as_pairs(v[8], "swap_out"), as_pairs(v[9], "swap_in"), as_pairs(v[10], "copies"),
        )
        if len(plan.scheduled_seq_ids) != len(plan.num_new_tokens):
            raise WireError("plan: scheduled_seq_ids and num_new_tokens differ in length")
        return plan


@dataclass(slots=True)
class SeqLogprobs:
    """Log-probs for one sampled token: its own and the top alternatives."""

    seq_id: int
    token_logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]

    def to_wire(self) -> list:
        return [self.seq_id, self.token_logprob, self.top_token_ids, self.top_logprobs]

    @classmethod
    def from_wire(cls, v: Any) -> SeqLogprobs:
        v = as_list(v, "seq_logprobs", 4)
        return cls(as_int(v[0], "seq_id"), as_float(v[1], "token_logprob"),
                   as_ints(v[2], "top_token_ids"),
                   [as_float(x, "top_logprobs") for x in as_list(v[3], "top_logprobs")])


@dataclass(slots=True)
class StepResult:
    """What one executed plan produced.

    ``sampled_seq_ids[i]`` got token ``sampled_token_ids[i]`` (only sequences
    whose computed count reached their token count sample). Beam sequences
    instead appear in ``beam_candidates`` as (seq_id, token ids, log-probs), best
    first, and do not append anything themselves. ``error`` is set when the
    step failed as a whole; the scheduler then fails that step's requests.
    """

    step_id: int
    sampled_seq_ids: list[int] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[SeqLogprobs] = field(default_factory=list)
    beam_candidates: list[SeqLogprobs] = field(default_factory=list)  # token_logprob unused (0.0)
    error: str | None = None
    model_seconds: float = 0.0

    def to_wire(self) -> list:
        return [self.step_id, self.sampled_seq_ids, self.sampled_token_ids,
                [x.to_wire() for x in self.logprobs], [x.to_wire() for x in self.beam_candidates],
                self.error, self.model_seconds]

    @classmethod
    def from_wire(cls, v: Any) -> StepResult:
        v = as_list(v, "result", 7)
        res = cls(as_int(v[0], "step_id"), as_ints(v[1], "sampled_seq_ids"), as_ints(v[2], "sampled_token_ids"),
                  [SeqLogprobs.from_wire(x) for x in as_list(v[3], "logprobs")],
                  [SeqLogprobs.from_wire(x) for x in as_list(v[4], "beam_candidates")],
                  None if v[5] is None else as_str(v[5], "error"), as_float(v[6], "model_seconds"))
        if len(res.sampled_seq_ids) != len(res.sampled_token_ids):
            raise WireError("result: sampled_seq_ids and sampled_token_ids differ in length")
        return res


@dataclass(slots=True)
class Handshake:
    """First message of an executor: who it is and what its KV cache holds."""

    executor_id: str
    wire_version: int
    model_fingerprint: str  # sha256 over config.json and weight names/shapes/dtypes
    model_name: str
    architecture: str
    vocab_size: int
    block_size: int
    num_device_blocks: int
    num_cpu_blocks: int
    max_model_len: int
    dtype: str
    device: str

    def to_wire(self) -> list:
        return [self.executor_id, self.wire_version, self.model_fingerprint, self.model_name,
                self.architecture, self.vocab_size, self.block_size, self.num_device_blocks,
                self.num_cpu_blocks, self.max_model_len, self.dtype, self.device]

    @classmethod
    def from_wire(cls, v: Any) -> Handshake:
        v = as_list(v, "handshake", 12)
        return cls(as_str(v[0], "executor_id"), as_int(v[1], "wire_version"),
                   as_str(v[2], "model_fingerprint"), as_str(v[3], "model_name"),
                   as_str(v[4], "architecture"), as_int(v[5], "vocab_size"), as_int(v[6], "block_size"),
                   as_int(v[7], "num_device_blocks"), as_int(v[8], "num_cpu_blocks"),
                   as_int(v[9], "max_model_len"), as_str(v[10], "dtype"), as_str(v[11], "device"))


@dataclass(slots=True)
class HandshakeReply:
    accepted: bool
    reason: str = ""
    heartbeat_interval_s: float = 1.0

    def to_wire(self) -> list:
        return [self.accepted, self.reason, self.heartbeat_interval_s]

    @classmethod
    def from_wire(cls, v: Any) -> HandshakeReply:
        v = as_list(v, "handshake_reply", 3)
        return cls(as_bool(v[0], "accepted"), as_str(v[1], "reason"), as_float(v[2], "heartbeat_interval_s"))


@dataclass(slots=True)
class Heartbeat:
    sent_at: float  # sender's time.time(), for logging skew only

    def to_wire(self) -> list:
        return [self.sent_at]

    @classmethod
    def from_wire(cls, v: Any) -> Heartbeat:
        v = as_list(v, "heartbeat", 1)
        return cls(as_float(v[0], "sent_at"))


@dataclass(slots=True)
class Drain:
    """Executor -> scheduler: stop routing new work here; finish or migrate."""

    grace_seconds: float

    def to_wire(self) -> list:
        return [self.grace_seconds]

    @classmethod
    def from_wire(cls, v: Any) -> Drain:
        v = as_list(v, "drain", 1)
        return cls(as_float(v[0], "grace_seconds"))


Message = Handshake | HandshakeReply | Heartbeat | BatchPlan | StepResult | Drain

_KIND_OF: dict[type, int] = {
    Handshake: KIND_HANDSHAKE, HandshakeReply: KIND_HANDSHAKE_REPLY, Heartbeat: KIND_HEARTBEAT,
    BatchPlan: KIND_PLAN, StepResult: KIND_RESULT, Drain: KIND_DRAIN,
}
_TYPE_OF: dict[int, type] = {k: t for t, k in _KIND_OF.items()}


def encode(msg: Message) -> bytes:
    """Serialize a message to one frame."""
    return msgpack.packb([WIRE_VERSION, _KIND_OF[type(msg)], msg.to_wire()], use_bin_type=True)


def decode(frame: bytes) -> Message:
    """Parse one frame; raise WireError on anything that is not a valid message."""
    if len(frame) > MAX_FRAME_BYTES:
        raise WireError(f"frame of {len(frame)} bytes exceeds the limit of {MAX_FRAME_BYTES}")
    try:
        obj = msgpack.unpackb(
            frame, raw=False, strict_map_key=True, use_list=True,
            max_array_len=_MAX_ARRAY_LEN, max_str_len=1024 * 1024,
            max_map_len=0, max_bin_len=0, max_ext_len=0,
        )
    except WireError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types
        raise WireError(f"not a msgpack frame: {exc}") from exc
    obj = as_list(obj, "frame", 3)
    version = as_int(obj[0], "wire_version")
    if version != WIRE_VERSION:
        raise WireError(f"wire version {version}, expected {WIRE_VERSION}")
    kind = as_int(obj[1], "kind")
    cls = _TYPE_OF.get(kind)
    if cls is None:
        raise WireError(f"unknown message kind {kind}")
    try:
        return cls.from_wire(obj[2])
    except WireError:
        raise
    except (TypeError, ValueError, IndexError) as exc:
        raise WireError(f"malformed {cls.__name__}: {exc}") from exc
