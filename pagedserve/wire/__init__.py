"""The scheduler <-> executor contract: messages, their codec and protocol constants.

Both services import this package and neither owns it (``scheduler_svc`` and
``executor_svc`` never import each other). ``from pagedserve import wire``
then ``wire.BatchPlan``, ``wire.encode(msg)``, ``wire.decode(frame)``,
``wire.WIRE_VERSION``.
"""

from pagedserve.wire.codec import Envelope, WireError, decode, decode_body, encode, read_envelope
from pagedserve.wire.messages import (
    KIND_OF,
    BatchPlan,
    BlockUpdate,
    DraftProposal,
    Drain,
    Fork,
    Handshake,
    HandshakeReply,
    Heartbeat,
    LoraFailure,
    LoraLoad,
    Message,
    NewSeq,
    PromptLogprobs,
    Proposal,
    Reset,
    SamplingParams,
    SeqLogprobs,
    SeqRejection,
    SpecTokens,
    StepResult,
    Structured,
)
from pagedserve.wire.packed import num_packed, pack_ids, unpacked
from pagedserve.wire.protocol import *  # noqa: F403  (the constants, each defined once there)
from pagedserve.wire.protocol import MAX_FRAME_BYTES, WIRE_VERSION
from pagedserve.wire.result_bound import max_result_bytes

__all__ = [
    "KIND_OF", "MAX_FRAME_BYTES", "WIRE_VERSION", "BatchPlan", "BlockUpdate", "Drain", "DraftProposal", "Envelope",
    "Fork",
    "Handshake", "HandshakeReply", "Heartbeat", "LoraFailure", "LoraLoad", "Message", "NewSeq", "PromptLogprobs",
    "Proposal", "Reset", "SamplingParams", "SeqLogprobs", "SeqRejection",
    "SpecTokens",
    "StepResult", "Structured", "WireError", "decode", "decode_body", "encode", "max_result_bytes", "num_packed", "pack_ids",
    "read_envelope", "unpacked",
]
