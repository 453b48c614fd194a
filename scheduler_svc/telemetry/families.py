"""The fronts' metrics, gathered at the engine core: one /metrics for the whole deployment.

Each front counts what it sees (tokens streamed, time to first token, inter-token latency, how
requests ended, what its API rejected) in its own registry and sends the lot to the core every
second (``FrontMetrics``: prometheus_client's families as plain tuples). The core sums them, the
counters of fronts gone included, so that a counter never goes back, and exposes the sum beside
its own gauges on ``--metrics-port``; a front's ``/metrics`` on the HTTP port asks the core for
the same text, so whichever front a scrape reaches, it reads the same deployment-wide values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

Family = tuple  # (name, type, documentation, [(sample name, [(label, value)], value)])
_CUMULATIVE = ("counter", "histogram")


def families_of(registry: CollectorRegistry) -> list[Family]:
    """A registry's metrics as plain tuples (what a front sends)."""
    out = []
    for fam in registry.collect():
        samples = [(s.name, sorted(s.labels.items()), float(s.value)) for s in fam.samples
                   if not s.name.endswith("_created")]  # (creation times do not add up)
        out.append((fam.name, fam.type, fam.documentation, samples))
    return out


def merge_families(lists: Iterable[list[Family]], cumulative_only: bool = False) -> list[Family]:
    """Sum families of the same name, sample by sample (``cumulative_only``: counters and
    histograms only, e.g. to keep what a front that went away had counted)."""
    merged: dict[str, tuple[str, str, str, dict]] = {}
    for families in lists:
        for name, kind, doc, samples in families:
            if cumulative_only and kind not in _CUMULATIVE:
                continue
            entry = merged.setdefault(name, (name, kind, doc, {}))
            values = entry[3]
            for sample, labels, value in samples:
                key = (sample, tuple(tuple(kv) for kv in labels))
                values[key] = values.get(key, 0.0) + value
    return [(name, kind, doc, [(s, [list(kv) for kv in labels], v) for (s, labels), v in values.items()])
            for name, kind, doc, values in merged.values()]


# The deployment's families vLLM's dashboards and alerts read, under vLLM's names too (with its
# model_name label): what a Grafana board or an autoscaler written for vLLM finds. The gauges the
# inference gateway reads are vllm: families of their own (metrics.py).
VLLM_NAMES = {f"pagedserve:{name}": f"vllm:{name}" for name in (
    "prompt_tokens", "generation_tokens", "request_success", "num_preemptions", "prefix_cache_queries",
    "prefix_cache_hits", "time_to_first_token_seconds", "inter_token_latency_seconds",
    "e2e_request_latency_seconds", "request_queue_time_seconds", "request_prompt_tokens",
    "request_generation_tokens")}


def with_vllm_names(families: list[Family], model_name: str | None) -> list[Family]:
    """``families`` and, once the model is known, a copy of each of VLLM_NAMES' under vLLM's name."""
    if model_name is None:
        return families
    label = ("model_name", model_name)
    copies = [(VLLM_NAMES[name], kind, doc, [(VLLM_NAMES[name] + sample[len(name):], [label, *labels], value)
                                             for sample, labels, value in samples])
              for name, kind, doc, samples in families if name in VLLM_NAMES]
    return families + copies


class CumulativeSources:
    """Families from sources that come, go and restart (fronts, engine cores), summed so that no
    counter goes back and none is counted twice: a source gone keeps its last counters and
    histograms; one back under the same key goes on from them (the same process); one whose totals
    fell (a restarted process, counting from 0 again) has its former ones kept beneath.

    Fronts are named by host and pid, so each rollout brings new keys: past ``max_gone`` sources
    gone, the longest gone is folded into the base for good (memory and the cost of a scrape stay
    bounded). Should one of those come back after all, it counts from its return: what it counted
    while away is not seen, and nothing is counted twice."""

    def __init__(self, max_gone: int = 64) -> None:
        self.max_gone = max_gone
        self._base: list[Family] = []  # the totals of sources' earlier lives
        self._last: dict[object, list[Family]] = {}
        self._live: set[object] = set()
        self._gone: dict[object, None] = {}  # in the order they went
        self._retired: dict[object, None] = {}  # folded into the base: their keys (the latest 64 x max_gone)
        self._offset: dict[object, list[Family]] = {}  # a retired source back: its totals on return

    def update(self, key: object, families: list[Family]) -> None:
        if not families:
            return  # (no figures, e.g. an empty answer: not a restart)
        old = self._last.get(key)
        if old is None and key in self._retired:
            del self._retired[key]
            self._offset[key] = families  # back after it was folded away: count from here
        elif old is not None and _fell(old, families):
            self._base = merge_families([self._base, self._counted(key, old)], cumulative_only=True)
            self._offset.pop(key, None)  # (a new process: all it counts is new)
        self._last[key] = families
        self._live.add(key)
        self._gone.pop(key, None)

    def gone(self, key: object) -> None:
        if key not in self._live:
            return
        self._live.discard(key)
        self._gone[key] = None
        while len(self._gone) > self.max_gone:
            oldest = next(iter(self._gone))
            del self._gone[oldest]
            self._base = merge_families([self._base, self._counted(oldest, self._last.pop(oldest))],
                                        cumulative_only=True)
            self._offset.pop(oldest, None)
            self._retired[oldest] = None
            if len(self._retired) > 64 * self.max_gone:
                del self._retired[next(iter(self._retired))]

    def total(self) -> list[Family]:
        kept = merge_families([self._base, *(self._counted(k, f) for k, f in self._last.items() if k not in self._live)],
                              cumulative_only=True)
        return merge_families([kept, *(self._counted(k, f) for k, f in self._last.items() if k in self._live)])

    def _counted(self, key: object, families: list[Family]) -> list[Family]:
        """What a source's families add to the total: all of them, or past its return if retired."""
        offset = self._offset.get(key)
        if offset is None:
            return families
        return merge_families([families, [(n, k, d, [(s, lb, -v) for s, lb, v in samples])
                                          for n, k, d, samples in offset if k in _CUMULATIVE]])


def _fell(old: list[Family], new: list[Family]) -> bool:
    """Whether a counter or histogram sample of ``old`` is smaller (or absent) in ``new``."""
    now = {(sample, tuple(tuple(kv) for kv in labels)): value for _, kind, _, samples in new
           if kind in _CUMULATIVE for sample, labels, value in samples}
    return any(now.get((sample, tuple(tuple(kv) for kv in labels)), 0.0) < value
               for _, kind, _, samples in old if kind in _CUMULATIVE for sample, labels, value in samples)


class FamiliesCollector(Collector):
    """Exposes families that ``source()`` returns (the fronts' sum) in a registry of the core's."""

    def __init__(self, source: Callable[[], list[Family]]) -> None:
        self.source = source

    def collect(self):
        for name, kind, doc, samples in self.source():
            metric = Metric(name, doc, kind)
            for sample, labels, value in samples:
                metric.add_sample(sample, dict(labels), value)
            yield metric
