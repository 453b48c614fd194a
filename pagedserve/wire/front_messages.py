"""The messages between the scheduler's front processes and its engine cores, each declared once.

A front (``pagedserve-front``, or one the scheduler starts) dials a core's front link with a
ZeroMQ DEALER; the core's ROUTER serves every front. Frames are ``[TIER_VERSION, KIND, 0, body]``,
decoded with the executor link's bounded codec (``pagedserve.wire.codec.Codec``).

front -> core: ``FrontHello`` first (answered by ``CoreHello``), then ``Submit`` (a request, its
prompt hashed; its prompt token ids packed, see :func:`pack_ids`), ``Abort`` (its client went away, or stop strings ended it), ``FinishChoice`` (a
stop string ended one choice), ``FrontMetrics`` (its counters, for the deployment's /metrics),
``Query`` (fresh stats, or the deployment's metrics) and ``Heartbeat``.

core -> front: ``Updates`` (one step's token updates of that front's requests, or a request not
admitted: an error update), ``Status`` (readiness, model info, stats, health; also the core's
heartbeat) and ``Answer``.

A front may only name the requests it submitted (the core checks their ids carry the front's
prefix); a peer silent for ``DEAD_AFTER_INTERVALS`` heartbeats is dead: a dead front's requests
are aborted and their blocks freed, a dead core's requests fail (or move to another core).
"""

from __future__ import annotations

import secrets
from typing import Annotated

import msgspec
from msgspec import Meta

from pagedserve.engine_api import (
    EngineStats,
    FinishReason,
    GenerationRequest,
    ModelInfo,
    RequestUpdate,
    TokenId,
)
from pagedserve.lora_modules import MAX_NAME_CHARS as MAX_LORA_NAME_CHARS
from pagedserve.wire.codec import Codec

# One message family with the executor link: the same base, heartbeat, text and packed-id types.
from pagedserve.wire.link_messages import Heartbeat
from pagedserve.wire.packed import num_packed, pack_ids, unpacked  # noqa: F401  (the front link's helpers)
from pagedserve.wire.protocol import MAX_CHOICES, MAX_LORA_PATH_CHARS, MAX_REQUEST_ID_CHARS, MAX_SEQ_TOKENS
from pagedserve.wire.schema import PackedTokenIds, Text, WireMessage

TIER_VERSION = 5  # 5: per-request speculative acceptance (RequestUpdate.spec_*); 4: LoRA adapters
HEARTBEAT_INTERVAL_S = 0.5  # both ways; a peer silent for 5 intervals (2.5 s) is dead
MAX_FRAME_BYTES = 64 * 1024 * 1024  # a step's updates with log-probs; a request at the largest context

Id = Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS)]
Ended = Annotated[int, Meta(ge=int(FinishReason.LENGTH), le=int(max(FinishReason)))]  # how a resumed choice ended
ResumedOutput = Annotated[list[TokenId], Meta(max_length=MAX_SEQ_TOKENS)]  # one choice's tokens streamed so far
# Durations on the link (a queue time, a deadline): a sender clamps a longer one to this (31 years, no
# deadline in effect); a receiver refuses a frame with one past it.
MAX_SECONDS = 1e9
Seconds = Annotated[float, Meta(ge=0.0, le=MAX_SECONDS)]
# This process's incarnation, in its hello: a peer back under the same name (a front id, a core) with
# another one is a new process whose counters start from 0, and not the same one reconnecting.
INCARNATION = secrets.randbits(63)
Incarnation = Annotated[int, Meta(ge=0)]  # 0: not said (the counters' fall tells a restart, families.py)


class FrontHello(WireMessage):
    front_id: Id  # unique among the core's fronts; its requests' ids start with it
    tier_version: int
    incarnation: Incarnation = 0


class CoreHello(WireMessage):
    accepted: bool
    reason: Text = ""
    heartbeat_interval_s: Seconds = HEARTBEAT_INTERVAL_S
    incarnation: Incarnation = 0


class Submit(WireMessage):
    """A request, validated and tokenized, its prompt hashed, under the id the front gives it.
    Times are relative: the front's clock is not the core's. The prompt's token ids travel packed in
    ``prompt_ids``; the request's own ``prompt_token_ids`` is empty on the link."""

    request: GenerationRequest
    prompt_ids: PackedTokenIds  # little-endian uint32s: decoding them is one copy
    queued_s: Seconds  # since it arrived at the front
    deadline_in_s: Seconds | None = None  # None: no deadline
    # It ran on an engine core that was lost: each choice's tokens streamed so far, and how each that
    # ended ended (FinishReason values; None: still running). It goes on from there.
    resume_outputs: Annotated[list[ResumedOutput], Meta(max_length=MAX_CHOICES)] | None = None
    resume_finished: Annotated[list[Ended | None], Meta(max_length=MAX_CHOICES)] = msgspec.field(default_factory=list)


class Abort(WireMessage):
    request_id: Id


class FinishChoice(WireMessage):
    request_id: Id
    index: Annotated[int, Meta(ge=0, le=1 << 16)]


class Updates(WireMessage):
    updates: list[RequestUpdate]


class Status(WireMessage):
    """The core's state as its fronts show it (sent every heartbeat and when readiness changes)."""

    ready: bool
    model_info: ModelInfo | None
    stats: EngineStats
    health_problem: Text | None = None


Sample = tuple[str, list[tuple[str, str]], float]  # (sample name, labels, value)
Family = tuple[str, str, str, list[Sample]]  # (name, type, documentation, samples), as prometheus_client has them


class FrontMetrics(WireMessage):
    """A front's own metrics (counters and histograms cumulative); the core sums its fronts'."""

    families: Annotated[list[Family], Meta(max_length=10_000)]


QUERY_STATS, QUERY_METRICS, QUERY_FAMILIES = 1, 2, 3


class Query(WireMessage):
    """Ask the core for something fresher than its last Status: its stats, the deployment's metrics,
    or its own metrics (the first engine core asks the others, and exposes the sum)."""

    query_id: Annotated[int, Meta(ge=0)]
    what: Annotated[int, Meta(ge=QUERY_STATS, le=QUERY_FAMILIES)]


class LoraUpdate(WireMessage):
    """Serve the LoRA adapter at ``path`` as ``name`` from now on, or (``path`` None) stop serving
    ``name`` (``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``). Answered by an Answer whose
    ``error`` says why not, if it was not done."""

    query_id: Annotated[int, Meta(ge=0)]
    name: Annotated[str, Meta(min_length=1, max_length=MAX_LORA_NAME_CHARS)]
    path: Annotated[str, Meta(min_length=1, max_length=MAX_LORA_PATH_CHARS)] | None = None


class Answer(WireMessage):
    query_id: int
    stats: EngineStats | None = None
    text: str | None = None  # the Prometheus exposition of the whole deployment
    families: list[Family] | None = None  # this core's own metrics (another engine core sums them)
    error: Text | None = None  # a LoraUpdate not done: why
    not_found: bool = False  # (an unload of a name not served)


Message = (FrontHello | CoreHello | Submit | Abort | FinishChoice | Heartbeat | Updates | Status | FrontMetrics
           | Query | Answer | LoraUpdate)
KIND_OF: dict[type, int] = {FrontHello: 1, CoreHello: 2, Submit: 3, Abort: 4, FinishChoice: 5, Heartbeat: 6,
                            Updates: 7, Status: 8, FrontMetrics: 9, Query: 10, Answer: 11, LoraUpdate: 12}
FROM_FRONT = (FrontHello, Submit, Abort, FinishChoice, Heartbeat, FrontMetrics, Query, LoraUpdate)
FROM_CORE = (CoreHello, Updates, Status, Heartbeat, Answer)
TIER = Codec(TIER_VERSION, KIND_OF)
