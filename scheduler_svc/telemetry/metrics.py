"""Prometheus metrics in the vLLM dashboard style (``pagedserve:`` prefix).

One :class:`Metrics` object owns a dedicated ``CollectorRegistry`` (never the
global default, so tests and several engines in one process do not collide).
The engine calls its small ``on_*`` methods and :meth:`Metrics.observe_stats`
once per loop iteration (or on a timer); metrics_server.py serves ``/metrics``
over HTTP on ``--metrics-port``.
"""

from __future__ import annotations

import bisect
import math
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable
from typing import Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pagedserve.engine_api import EngineStats, FinishReason


class Budget(Protocol):
    """What /metrics reads of a front's call budget (front/guards/admission.py ``CallBudget``)."""

    calls: int
    bytes: int


P = "pagedserve:"
# Buckets follow vLLM's, so its Grafana dashboard reads these unchanged.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
               50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)


class BatchHistogram(Collector):
    """A histogram observed a step at a time.

    The engine has one inter-token latency per running sequence per step (256 and
    more): prometheus_client's Histogram takes a lock and walks its buckets for each
    observation, which cost more than the rest of the step's bookkeeping together.
    This takes a whole step's values in one call (one lock) and is exposed in the
    same Prometheus histogram format.
    """

    def __init__(self, name: str, documentation: str, buckets: Iterable[float],
                 registry: CollectorRegistry) -> None:
        self.name, self.documentation = name, documentation
        self.bounds = [float(b) for b in buckets]  # upper bounds (le), +Inf implied
        self._counts = [0] * (len(self.bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()  # collect() runs in the /metrics server's thread
        registry.register(self)

    def observe_many(self, values: list[float]) -> None:
        # A step's values repeat (every request streamed at the same moment whose last token came
        # in the same earlier step has the same gap): count them in C, bisect each distinct one.
        bounds, counts = self.bounds, self._counts
        distinct = Tally(values)
        slots = [(bisect.bisect_left(bounds, v), c) for v, c in distinct.items()]  # first bound >= v
        total = sum(values)
        with self._lock:
            for i, c in slots:
                counts[i] += c
            self._sum += total

    def collect(self):
        with self._lock:
            counts, total = list(self._counts), self._sum
        cumulative, buckets = 0, []
        for bound, count in zip([*self.bounds, math.inf], counts, strict=True):
            cumulative += count
            buckets.append((floatToGoString(bound), cumulative))
        yield HistogramMetricFamily(self.name, self.documentation, buckets=buckets, sum_value=total)


class _LoraInfo(Collector):
    """vLLM's ``vllm:lora_requests_info``, which the inference gateway's endpoint picker reads to
    route by adapter: one sample whose labels name the adapters of running and of waiting requests
    (comma-separated) and the most adapters a step computes; its value is the time of the scrape."""

    def __init__(self, stats: Callable[[], EngineStats]) -> None:
        self.stats = stats

    def collect(self):
        st = self.stats()
        family = GaugeMetricFamily("vllm:lora_requests_info", "Running stats on LoRA requests.",
                                   labels=["max_lora", "running_lora_adapters", "waiting_lora_adapters"])
        family.add_metric([str(st.max_lora), ",".join(st.lora_running), ",".join(st.lora_waiting)], time.time())
        yield family


class Metrics:
    """pagedserve's metrics, registered in ``self.registry``.

    ``part``: which half a process registers. An engine core counts what it schedules
    ("engine": requests running and waiting, KV usage, preemptions, migrations, queue time, and
    the ``vllm:`` gauges the Gateway API Inference Extension reads); a front counts what it
    streams and rejects ("front": tokens, latencies, how requests ended, admission). The engine
    core sums its fronts' into the one /metrics (``scheduler_svc/telemetry/families.py``); a process
    with both halves (tests, benchmarks) registers "all".
    """

    def __init__(self, registry: CollectorRegistry | None = None, part: str = "all") -> None:
        if part not in ("all", "engine", "front"):
            raise ValueError(f"Metrics part: expected all, engine or front, got {part!r}")
        r = self.registry = registry if registry is not None else CollectorRegistry()
        if part in ("all", "engine"):
            self._engine_metrics(r)
        if part in ("all", "front"):
            self._front_metrics(r)
        self._last: dict[str, int] = {"pq": 0, "ph": 0, "pre": 0, "mig": 0, "sd": 0, "sdt": 0, "sa": 0}  # cumulative engine counters already counted
        self._executors: set[str] = set()
        self._states: set[str] = set()
        self._lora_info: _LoraInfo | None = None
        self.model_name: str | None = None  # the served model's name, once known (the vllm: families' label)

    def _engine_metrics(self, r: CollectorRegistry) -> None:
        ex = ["executor"]
        self.num_running = Gauge(P + "num_requests_running", "Requests running on executors.", registry=r)
        self.num_waiting = Gauge(P + "num_requests_waiting", "Requests waiting to be scheduled.", registry=r)
        self.num_swapped = Gauge(P + "num_requests_swapped", "Requests swapped out to CPU memory.", registry=r)
        self.kv_usage = Gauge(P + "kv_cache_usage_perc", "Fraction of KV blocks in use (0..1).", ex, registry=r)
        self.kv_shared = Gauge(P + "kv_blocks_shared", "KV blocks with refcount > 1.", ex, registry=r)
        self.kv_cached = Gauge(P + "kv_blocks_cached", "Free KV blocks holding prefix-cache content.", ex,
                               registry=r)
        self.cpu_usage = Gauge(P + "cpu_cache_usage_perc", "Fraction of CPU swap blocks in use (0..1).", ex,
                               registry=r)
        self.num_executors = Gauge(P + "num_executors", "Executors known to the scheduler, by state.",
                                   ["state"], registry=r)
        self.tp_size = Gauge(P + "executor_tensor_parallel_size", "Ranks (GPUs) serving the model as this "
                             "executor (tensor parallelism; 1 = one device).", ex, registry=r)
        self.prefix_queries = Counter(P + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                      registry=r)
        self.prefix_hits = Counter(P + "prefix_cache_hits", "Prompt tokens found in the prefix cache.", registry=r)
        self.preemptions = Counter(P + "num_preemptions", "Preemptions (recompute and swap).", registry=r)
        self.migrations = Counter(P + "request_migrations", "Requests moved to another executor.", registry=r)
        self.queue_time = Histogram(P + "request_queue_time_seconds", "Arrival to first scheduled.",
                                    buckets=E2E_BUCKETS, registry=r)
        # What the Kubernetes Gateway API Inference Extension's endpoint picker reads of a vLLM
        # model server, under vLLM's names: this deployment as one model server.
        self.model_name = ["model_name"]
        self.vllm_running = Gauge("vllm:num_requests_running", "Requests running (the deployment's).",
                                  self.model_name, registry=r)
        self.vllm_waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be scheduled (the "
                                  "deployment's).", self.model_name, registry=r)
        self.vllm_kv_usage = Gauge("vllm:kv_cache_usage_perc", "Fraction of the deployment's KV blocks in use "
                                   "(0..1).", self.model_name, registry=r)
        # Speculative decoding, under vLLM's names (--speculative-config).
        self.spec_drafts = Counter("vllm:spec_decode_num_drafts", "Proposal rounds verified.", registry=r)
        self.spec_draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Tokens proposed.", registry=r)
        self.spec_accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Proposed tokens accepted.", registry=r)
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                             "Proposed tokens accepted, by position in their round.", ["position"],
                                             registry=r)

    def _front_metrics(self, r: CollectorRegistry) -> None:
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens prefilled.", registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated.", registry=r)
        self.success = Counter(P + "request_success", "Finished requests, by finish reason.",
                               ["finished_reason"], registry=r)
        self.rejected = Counter(P + "request_rejected", "Requests refused or failed, by gRPC status code.",
                                ["code"], registry=r)
        # Every admitted request ends exactly once: admitted == the sum of finished over its reasons.
        self.admitted = Counter(P + "request_admitted", "Requests the engine accepted.", registry=r)
        self.finished = Counter(P + "request_finished", "Requests the engine ended, by how: length, stop, eos, "
                                "aborted (cancelled, deadline, shutdown) or failed.", ["reason"], registry=r)
        self.shed = Counter(P + "request_shed", "Calls refused before they were read, by cap: max_concurrent_calls, "
                            "max_in_flight_bytes, auth_throttled, open_reads_per_peer (also counted in request_rejected as "
                            "RESOURCE_EXHAUSTED).", ["reason"], registry=r)
        self.calls_in_progress = Gauge(P + "calls_in_progress", "Calls holding a slot of --max-concurrent-calls "
                                       "(both fronts; health checks not counted).", registry=r)
        self.request_bytes_in_flight = Gauge(P + "request_bytes_in_flight", "Request bytes of the calls in progress, "
                                             "against --max-in-flight-bytes.", registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time to first token.",
                              buckets=TTFT_BUCKETS, registry=r)
        self.itl = BatchHistogram(P + "inter_token_latency_seconds", "Time between consecutive tokens.",
                                  ITL_BUCKETS, r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to finish.", buckets=E2E_BUCKETS,
                             registry=r)
        self.req_prompt_tokens = Histogram(P + "request_prompt_tokens", "Prompt tokens per request.",
                                           buckets=TOKEN_BUCKETS, registry=r)
        self.req_generation_tokens = Histogram(P + "request_generation_tokens", "Generated tokens per request.",
                                               buckets=TOKEN_BUCKETS, registry=r)

    # ---- called by the engine -------------------------------------------------
    def observe_stats(self, stats: EngineStats) -> None:
        """Set gauges from a snapshot and advance counters by what the engine's totals grew."""
        self.num_running.set(stats.num_running)
        self.num_waiting.set(stats.num_waiting)
        self.num_swapped.set(stats.num_swapped)
        self._advance(self.prefix_queries, "pq", stats.prefix_cache_query_tokens)
        self._advance(self.prefix_hits, "ph", stats.prefix_cache_hit_tokens)
        self._advance(self.preemptions, "pre", stats.num_preemptions)
        self._advance(self.migrations, "mig", stats.num_migrations)
        self._advance(self.spec_drafts, "sd", stats.spec_num_drafts)
        self._advance(self.spec_draft_tokens, "sdt", stats.spec_num_draft_tokens)
        self._advance(self.spec_accepted, "sa", stats.spec_num_accepted_tokens)
        for pos, n in enumerate(stats.spec_accepted_per_pos):
            self._advance(self.spec_accepted_per_pos.labels(str(pos)), f"sap{pos}", n)
        seen: set[str] = set()
        states: dict[str, int] = {}
        for e in stats.executors:
            seen.add(e.id)
            states[e.state] = states.get(e.state, 0) + 1
            self.kv_usage.labels(e.id).set(e.kv_blocks_used / e.kv_blocks_total if e.kv_blocks_total else 0.0)
            self.kv_shared.labels(e.id).set(e.kv_blocks_shared)
            self.kv_cached.labels(e.id).set(e.kv_blocks_cached)
            self.cpu_usage.labels(e.id).set(e.cpu_blocks_used / e.cpu_blocks_total if e.cpu_blocks_total else 0.0)
            self.tp_size.labels(e.id).set(e.tensor_parallel_size)
        for gone in self._executors - seen:  # an executor that left stops being reported
            for g in (self.kv_usage, self.kv_shared, self.kv_cached, self.cpu_usage, self.tp_size):
                g.remove(gone)
        self._executors = seen
        for state in self._states | states.keys():
            self.num_executors.labels(state).set(states.get(state, 0))
        self._states |= states.keys()

    def watch_deployment(self, model_name: str, stats: Callable[[], EngineStats]) -> None:
        """The vllm: gauges, read from ``stats()`` (the whole deployment's) when /metrics is scraped."""
        def kv_usage() -> float:
            st = stats()
            total = sum(e.kv_blocks_total for e in st.executors)
            return sum(e.kv_blocks_used for e in st.executors) / total if total else 0.0

        if self._lora_info is None:  # (one collector per registry, whichever executor joined first)
            self._lora_info = _LoraInfo(stats)
            self.registry.register(self._lora_info)
        self._lora_info.stats = stats
        self.model_name = model_name
        self.vllm_running.labels(model_name).set_function(lambda: stats().num_running)
        self.vllm_waiting.labels(model_name).set_function(lambda: stats().num_waiting)
        self.vllm_kv_usage.labels(model_name).set_function(kv_usage)

    def on_scheduled(self, queue_seconds: float) -> None:
        """A request was scheduled for the first time ``queue_seconds`` after arrival."""
        self.queue_time.observe(queue_seconds)

    def on_prompt_tokens(self, n: int) -> None:
        self.prompt_tokens.inc(n)

    def on_first_token(self, seconds: float) -> None:
        """Arrival to the first generated token of a request."""
        self.ttft.observe(seconds)

    def on_step_tokens(self, num_tokens: int, inter_token_seconds: list[float]) -> None:
        """A step's worth of streamed tokens, and the inter-token latency of each that had a predecessor."""
        self.generation_tokens.inc(num_tokens)
        if inter_token_seconds:
            self.itl.observe_many(inter_token_seconds)

    def on_finish(self, reason: FinishReason, e2e_seconds: float, prompt_tokens: int,
                  generation_tokens: int) -> None:
        """A request finished (its last choice did)."""
        self.success.labels(FinishReason(reason).name.lower()).inc()
        self.finished.labels(FinishReason(reason).name.lower()).inc()
        self.e2e.observe(e2e_seconds)
        self.req_prompt_tokens.observe(prompt_tokens)
        self.req_generation_tokens.observe(generation_tokens)

    def on_admitted(self) -> None:
        self.admitted.inc()

    def on_failed(self) -> None:
        """A request the engine had admitted failed (its client got an error status)."""
        self.finished.labels("failed").inc()

    # ---- called by the servicer -----------------------------------------------
    def on_rejected(self, code: str) -> None:
        """A request ended with a non-OK status (e.g. "INVALID_ARGUMENT")."""
        self.rejected.labels(code).inc()

    def on_shed(self, reason: str) -> None:
        """A call rejected at the door (admission.py, auth_throttle.py); its status, RESOURCE_EXHAUSTED
        (429), is counted with on_rejected as every error status is."""
        self.shed.labels(reason).inc()

    def watch_budget(self, budget: Budget) -> None:
        """Report ``budget``'s calls and bytes in progress (read when /metrics is scraped)."""
        self.calls_in_progress.set_function(lambda: budget.calls)
        self.request_bytes_in_flight.set_function(lambda: budget.bytes)

    def _advance(self, counter: Counter, key: str, total: int) -> None:
        last = self._last.get(key, 0)
        counter.inc(total - last if total >= last else total)  # a smaller total: the source restarted
        self._last[key] = total
