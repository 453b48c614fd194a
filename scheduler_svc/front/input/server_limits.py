"""The limits the fronts enforce: per request at the API edge, and what the fronts of a process hold at once.

One frozen :class:`ServerLimits`, built once from the flags (each field is a flag,
``scheduler_svc/entrypoints/service_flags.py``). The validator (validation.py) and the request
counts (guards/request_caps.py) apply the per-request limits; the process caps are enforced by
guards/admission.py (which sizes those given as 0 for the machine) and guards/auth_throttle.py.
gRPC clients read the limits with GetModelInfo (:meth:`ServerLimits.to_proto`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pagedserve.request_bounds import RequestLimits
from pagedserve.v1 import generation_pb2 as pb

# Duplicate stop strings and stop token ids collapse before their limit counts (naming one string
# 20 times asks for one), but the list as sent is bounded too, at this many times the limit: a
# client must not make a front dedupe a million entries.
RAW_LIST_FACTOR = 4


def raw_list_problem(n: int, limit: int) -> str | None:
    """Why a stop list of ``n`` entries as sent (duplicates included) is refused unread, or None."""
    cap = RAW_LIST_FACTOR * max(limit, 1)
    return f"at most {cap} entries as sent, duplicates included (got {n})" if n > cap else None


@dataclass(frozen=True, slots=True)
class ServerLimits(RequestLimits):
    """Per-request limits the servicer enforces (:class:`RequestLimits`: the engine core holds a front's
    requests to its own again), and what the fronts of one process hold at once (built once in
    __main__; the caps are enforced by admission.py and auth_throttle.py)."""

    # Caps that may be 0: sized for the machine when the server starts (admission.sized_for_machine).
    MACHINE_SIZED: ClassVar[frozenset[str]] = frozenset({"max_concurrent_calls", "max_in_flight_bytes"})

    default_max_tokens: int = 16  # when max_tokens is 0/unset (capped by the context left)
    max_request_id_len: int = 128
    # Per process, both fronts together (health checks excepted): calls in progress, and the
    # request bytes (HTTP bodies, gRPC messages) of those calls; over either, 429 / RESOURCE_EXHAUSTED.
    max_concurrent_calls: int = 0
    max_in_flight_bytes: int = 0
    # Failed API-key attempts per peer (IP address; an IPv6 /64): a burst, then one more every
    # auth_failure_refill_s seconds; beyond, the peer's calls get 429 / RESOURCE_EXHAUSTED unread.
    auth_failure_burst: int = 10
    auth_failure_refill_s: int = 6

    @classmethod
    def zero_allowed(cls, name: str) -> bool:
        return name in cls.ZERO_ALLOWED or name in cls.MACHINE_SIZED

    def to_proto(self) -> pb.ServerLimits:
        return pb.ServerLimits(**{name: getattr(self, name) for name in pb.ServerLimits.DESCRIPTOR.fields_by_name})
