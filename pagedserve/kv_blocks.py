"""Block arithmetic that the fronts and the scheduler both do: prefix-cache keys and block counts.

A front hashes a prompt's full blocks before it submits it (so the engine core's loop never
spends a request's size on hashing), and turns away a request too large for any executor; the scheduler
keys its prefix cache by the same hashes and holds the same counts. One definition each, here,
so that the two sides cannot disagree about what a block is.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence as Seq

BLOCK_HASH_BYTES = 32  # a block's hash: a sha256 digest
_ROOT_HASH = b"\x00" * BLOCK_HASH_BYTES


def lora_key(lora: str | None, lora_id: int = 0) -> str | None:
    """What tells one LoRA adapter from another: its name, and for an adapter loaded at run time the
    id of that load (scheduler_svc/engine/lora_registry.py); None for the base model. One key per
    (name, id): ``name#id``, the id after the last ``#``, except that a name without ``#`` given at
    start is its own key (names may hold ``#``: ``x#1`` given at start is not ``x``'s first load)."""
    if not lora:
        return None
    return lora if not lora_id and "#" not in lora else f"{lora}#{lora_id}"


MAX_CACHE_SALT_CHARS = 1024  # a request's cache_salt (vLLM's): 43 base64 characters carry 256 bits


def chain_root(lora: str | None, lora_id: int = 0, salt: str | None = None) -> bytes | None:
    """The parent of a prompt's first block: the base model's (None), or for a LoRA adapter one of
    its own, since the adapter changes every K/V: the same prompt under two adapters shares no block.
    ``salt``: a request's ``cache_salt`` (vLLM's), so that only requests with the same salt share
    blocks: a tenant's prompts cannot be probed by timing another tenant's cache hits."""
    key = lora_key(lora, lora_id)
    root = None if key is None else hashlib.sha256(b"pagedserve-lora\x00" + key.encode()).digest()
    if salt:
        root = hashlib.sha256(b"pagedserve-salt\x00" + (root or b"") + salt.encode()).digest()
    return root


def hash_block(parent: bytes | None, token_ids: Seq[int], extra: bytes = b"") -> bytes:
    """Chained content hash of one full block: sha256(parent ‖ int64 tokens ‖ extra).

    The parent hash makes a block's identity depend on every token before it;
    ``extra`` carries whatever else changes the K/V (model fingerprint, salt).
    sha256 so that collisions (which would silently mix two prompts' caches)
    are not a practical concern.
    """
    h = hashlib.sha256(parent or _ROOT_HASH)
    h.update(array("q", token_ids).tobytes())
    h.update(extra)
    return h.digest()


def hash_blocks(parent: bytes | None, token_ids: Seq[int], block_size: int, extra: bytes = b"") -> list[bytes]:
    """:func:`hash_block` over each full block of ``token_ids`` in turn, chained from ``parent``.

    One pass: one conversion of all the tokens, one sha256 call per block (a 32K-token prompt
    in 1.9 ms instead of 2.4 with :func:`hash_block` per block; it runs on the event loop).
    """
    n = len(token_ids) // block_size
    data = array("q", token_ids[:n * block_size]).tobytes()
    step, sha, h = 8 * block_size, hashlib.sha256, parent or _ROOT_HASH
    out = []
    for i in range(0, n * step, step):
        h = sha(h + data[i:i + step] + extra).digest()
        out.append(h)
    return out


def request_blocks(prompt_len: int, max_tokens: int, width: int, max_model_len: int, block_size: int) -> int:
    """KV blocks a request may hold at once at its longest: ``width`` choices or beams at full length."""
    longest = min(prompt_len + max_tokens, max_model_len)
    return width * -(-longest // block_size)
