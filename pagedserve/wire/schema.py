"""The wire's field types and its message base, shared by both links.

Every message is a ``msgspec.Struct`` with ``array_like=True``: it travels as a positional msgpack
array whose element order is its field order, so the declaration *is* the schema (a change of
order or meaning bumps ``WIRE_VERSION``, or the front link's ``TIER_VERSION``). The ``Meta``
bounds below are checked when a frame is decoded (never on construction): they are what a peer
may send, not policy.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from pagedserve.wire import protocol as p

# Bounded scalar and container types (checked when decoding).
Id = Annotated[int, Meta(ge=0, le=p.MAX_INT32)]
Count = Annotated[int, Meta(ge=0, le=p.MAX_INT32)]
Seed = Annotated[int, Meta(ge=0)]  # (at most p.MAX_SEED: msgpack carries no larger integer)
Ids = Annotated[list[Id], Meta(max_length=p.MAX_SEQS_PER_STEP)]
Counts = Annotated[list[Count], Meta(max_length=p.MAX_SEQS_PER_STEP)]
# A sequence's tokens as little-endian uint32s (pagedserve/wire/packed.py): a prompt of 131K ids
# decodes as one copy instead of 131K int objects built while the receiver holds the GIL.
PackedTokenIds = Annotated[bytes, Meta(max_length=4 * p.MAX_SEQ_TOKENS)]
BlockIds = Annotated[list[Id], Meta(max_length=p.MAX_SEQ_TOKENS)]
Pairs = Annotated[list[tuple[Id, Id]], Meta(max_length=p.MAX_BLOCK_PAIRS)]
TopIds = Annotated[list[Id], Meta(max_length=p.MAX_TOP_LOGPROBS)]
TopValues = Annotated[list[float], Meta(max_length=p.MAX_TOP_LOGPROBS)]
Name = Annotated[str, Meta(max_length=p.MAX_ID_CHARS)]
Text = Annotated[str, Meta(max_length=p.MAX_TEXT_CHARS)]
_FLOAT_MAX = 1.7976931348623157e308  # an upper bound that refuses inf (and NaN)
Finite = Annotated[float, Meta(ge=-_FLOAT_MAX, le=_FLOAT_MAX)]
NonNegative = Annotated[float, Meta(ge=0.0, le=_FLOAT_MAX)]
Positive = Annotated[float, Meta(gt=0.0, le=_FLOAT_MAX)]
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]


class WireMessage(msgspec.Struct, array_like=True, forbid_unknown_fields=True, gc=False):
    """Base of every wire message: positional, no extra elements, not GC-tracked (acyclic)."""
