"""Token ids packed as little-endian uint32s, 4 bytes each, on both links.

A prompt is the one list in a message that can hold 131K ids. As a msgpack array its decoding
builds an int object per id while holding the GIL (10 ms for 131K ids in an executor's plan); as
packed bytes it is one copy, and the receiver checks the ids with one vectorised pass and makes
ints only where it needs them. ``pack_ids`` runs at C speed too (``array``).
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Sequence

from pagedserve.wire.errors import WireError

U32 = next(t for t in "IL" if array(t).itemsize == 4)  # (the typecode of 4-byte unsigned ints here)
_SWAP = sys.byteorder != "little"


def pack_ids(ids: Sequence[int], what: str = "token_ids") -> bytes:
    """Ids (each in [0, 2**32)) packed; ValueError naming the first that is not (as ``what[i]``)."""
    try:
        a = array(U32, ids)
    except (OverflowError, TypeError):
        i, x = next(((i, x) for i, x in enumerate(ids) if not isinstance(x, int) or not 0 <= x < 1 << 32),
                    (None, None))
        raise ValueError(f"{what}[{i}]: must be a token id in [0, 2**32) (got {x!r})") from None
    if _SWAP:
        a.byteswap()
    return a.tobytes()


def num_packed(data: bytes) -> int:
    """How many ids ``data`` holds; WireError unless a whole number of them."""
    if len(data) % 4:
        raise WireError(f"packed token ids of {len(data)} bytes: not a multiple of 4")
    return len(data) // 4


def unpacked(data: bytes) -> array:
    """The ids as an ``array`` (a copy, no int objects yet); WireError as :func:`num_packed`."""
    num_packed(data)
    a = array(U32)
    a.frombytes(data)
    if _SWAP:
        a.byteswap()
    return a
