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
