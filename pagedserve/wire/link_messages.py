"""The executor link's own messages: who an executor is and whether it is taken (``Handshake``,
``HandshakeReply``), that each side is alive (``Heartbeat``), and the two ways out of the ordinary
step loop (``Drain``, ``Reset``). The steps' messages are in ``messages.py``.
"""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

from pagedserve.wire import protocol as p
from pagedserve.wire.schema import Count, Finite, Name, NonNegative, Text, WireMessage


class Handshake(WireMessage):
    """First message of an executor: who it is and what its KV cache holds."""

    executor_id: Annotated[str, Meta(min_length=1, max_length=p.MAX_ID_CHARS)]
    wire_version: int
    model_fingerprint: Name  # sha256 over config.json and weight names/shapes/dtypes
    model_name: Name
    architecture: Name
    vocab_size: Annotated[int, Meta(ge=1, le=p.MAX_INT32)]
    block_size: Annotated[int, Meta(ge=1, le=1024)]
    num_device_blocks: Count
    num_cpu_blocks: Count
    max_model_len: Annotated[int, Meta(ge=1, le=p.MAX_SEQ_TOKENS)]
    dtype: Name
    device: Name
    # Ranks serving this model as one executor (tensor parallelism); older executors omit it.
    tensor_parallel_size: Annotated[int, Meta(ge=1, le=p.MAX_TENSOR_PARALLEL_SIZE)] = 1
    # An enrollment token's HMAC over the link's keys and executor_id (pagedserve/wire/enrollment.py),
    # for an executor whose key the scheduler does not list; empty otherwise.
    enrollment_proof: Annotated[bytes, Meta(max_length=64)] = b""
    # The most BatchPlan.decode_steps it serves (1: one step per plan).
    max_decode_steps: Annotated[int, Meta(ge=1, le=p.MAX_DECODE_STEPS)] = 1
    # It scores BatchPlan.proposals (speculative decoding); older executors omit it.
    speculative: bool = False
    # Its results are batch-invariant: a token's logits depend only on its context, never on the rest
    # of its step (executor_svc/batch_invariance.py); `numerics` names what else fixes its bits (weight
    # format, instruction set): with --batch-invariant every executor must agree on both.
    batch_invariant: bool = False
    numerics: Name = ""
    # LoRA: adapters it computes in one step (--max-loras; 0: none) and the highest rank it takes.
    lora_slots: Annotated[int, Meta(ge=0, le=p.MAX_LORA_SLOTS)] = 0
    max_lora_rank: Annotated[int, Meta(ge=0, le=256)] = 0
    # Speculative decoding by a draft model (--speculative-model): its name (its directory's) and its
    # vocabulary size; "" when it holds none. Its block pools share the target's block ids, so
    # num_device_blocks and num_cpu_blocks already count both models' bytes per block.
    draft_model: Name = ""
    draft_vocab_size: Annotated[int, Meta(ge=0, le=p.MAX_INT32)] = 0


class HandshakeReply(WireMessage):
    """The answer to a Handshake. ``redirect_port`` (not accepted, no reason needed): this port is the
    executor link of the engine core that is to schedule this executor (several engine cores: the
    port it dialled is their directory); dial it, on the same host, and handshake there. When that
    core goes silent, dial the directory again."""

    accepted: bool
    reason: Text = ""
    heartbeat_interval_s: Annotated[float, Meta(gt=0.0, le=3600.0)] = p.DEFAULT_HEARTBEAT_INTERVAL_S
    redirect_port: Annotated[int, Meta(ge=0, le=65535)] = 0


class Heartbeat(WireMessage):
    sent_at: Finite  # sender's time.time(), for logging skew only


class Drain(WireMessage):
    """Executor -> scheduler: stop routing new work here; finish or migrate."""

    grace_seconds: NonNegative


class Reset(WireMessage):
    """Scheduler -> executor: forget every sequence and stop refusing plans.

    Sent after a refused plan: the scheduler has taken that executor's requests back
    (they resume from their tokens, here or elsewhere, as after a migration). Every
    plan sent before the Reset is still answered, in order; the plans after it start
    from an empty sequence state.
    """

    reason: Text = ""
