"""The limits the fronts enforce: per request at the API edge, and what the fronts of a process hold at once.

One frozen :class:`ServerLimits`, built once from the flags (each field is a flag,
``scheduler_svc/entrypoints/service_flags.py``). The validator (validation.py) and the request
counts (guards/request_caps.py) apply the per-request limits; the process caps are enforced by
guards/admission.py (which sizes those given as 0 for the machine) and guards/auth_throttle.py.
gRPC clients read the limits with GetModelInfo (:meth:`ServerLimits.to_proto`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.wire.protocol import MAX_TOP_LOGPROBS

# Duplicate stop strings and stop token ids collapse before their limit counts (naming one string
# 20 times asks for one), but the list as sent is bounded too, at this many times the limit: a
# client must not make a front dedupe a million entries.
RAW_LIST_FACTOR = 4


def raw_list_problem(n: int, limit: int) -> str | None:
    """Why a stop list of ``n`` entries as sent (duplicates included) is refused unread, or None."""
    cap = RAW_LIST_FACTOR * max(limit, 1)
    return f"at most {cap} entries as sent, duplicates included (got {n})" if n > cap else None


@dataclass(frozen=True, slots=True)
class ServerLimits:
    """Per-request limits the servicer enforces, and what the fronts of one process hold at once
    (built once in __main__; the caps are enforced by admission.py and auth_throttle.py)."""

    # Limits that may be 0: that feature is then off (max_logprobs=0 still allows the sampled token's).
    ZERO_ALLOWED: ClassVar[frozenset[str]] = frozenset({"max_stop_strings", "max_stop_token_ids", "max_logprobs",
                                                        "max_logit_bias", "max_structured_chars"})
    # Caps that may be 0: sized for the machine when the server starts (admission.sized_for_machine).
    MACHINE_SIZED: ClassVar[frozenset[str]] = frozenset({"max_concurrent_calls", "max_in_flight_bytes"})
    # Limits the links bound: a request at a larger one would make a Submit the engine core refuses
    # (dropping its front, every request on it) or plans every executor refuses. Beam search asks
    # each beam for 2 x beam_width candidates (sched/lifecycle.py).
    WIRE_MAX: ClassVar[dict[str, int]] = {"max_logprobs": MAX_TOP_LOGPROBS, "max_beam_width": MAX_TOP_LOGPROBS // 2}

    max_n: int = 16
    max_beam_width: int = 8
    max_stop_strings: int = 16
    max_stop_string_len: int = 256  # characters
    max_stop_token_ids: int = 64
    max_logprobs: int = 20
    default_max_tokens: int = 16  # when max_tokens is 0/unset (capped by the context left)
    max_request_id_len: int = 128
    max_logit_bias: int = 1024  # entries of a request's logit_bias (0: not accepted)
    max_structured_chars: int = 65536  # characters of a JSON schema, regex or grammar (0: not accepted)
    # Per process, both fronts together (health checks excepted): calls in progress, and the
    # request bytes (HTTP bodies, gRPC messages) of those calls; over either, 429 / RESOURCE_EXHAUSTED.
    max_concurrent_calls: int = 0
    max_in_flight_bytes: int = 0
    # Failed API-key attempts per peer (IP address; an IPv6 /64): a burst, then one more every
    # auth_failure_refill_s seconds; beyond, the peer's calls get 429 / RESOURCE_EXHAUSTED unread.
    auth_failure_burst: int = 10
    auth_failure_refill_s: int = 6

    def __post_init__(self) -> None:
        for name in (f.name for f in dataclasses.fields(self)):
            value = getattr(self, name)
            low = 0 if name in self.ZERO_ALLOWED or name in self.MACHINE_SIZED else 1
            if not isinstance(value, int) or value < low:
                raise ValueError(f"ServerLimits.{name} must be an integer >= {low} (got {value!r})")
            if (high := self.WIRE_MAX.get(name)) is not None and value > high:
                raise ValueError(f"ServerLimits.{name} must be an integer in [{low}, {high}], what one sequence's "
                                 f"log-probs carry on the wire (got {value!r})")

    def to_proto(self) -> pb.ServerLimits:
        return pb.ServerLimits(**{name: getattr(self, name) for name in pb.ServerLimits.DESCRIPTOR.fields_by_name})
