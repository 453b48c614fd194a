"""Statistics and the report of a serving benchmark run (``pagedserve-bench``).

A run yields one :class:`RequestResult` per request: when it was sent, when
each streamed message with new tokens arrived and how many tokens it carried,
when the stream ended. :func:`summarize` turns them into the numbers the vLLM
paper and vLLM's own serving benchmark report:

* throughput: requests/s, output tokens/s, total (prompt + output) tokens/s,
  over the wall time from the first send to the last completion;
* normalized latency (paper §6.1): the mean over requests of end-to-end
  latency divided by the request's output length, in s/token;
* time to first token (TTFT), time per output token after the first (TPOT,
  per request), inter-token latency (ITL, per token: a message carrying k
  tokens after a gap g counts k gaps of g/k), end-to-end latency:
  mean and p50/p90/p99, in milliseconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class RequestResult:
    """What the client saw of one request. Times are ``time.perf_counter()`` seconds."""

    request_id: str
    prompt_len: int
    max_tokens: int  # the output length asked for
    send_time: float = 0.0
    end_time: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each message with new tokens
    chunk_tokens: list[int] = field(default_factory=list)  # tokens in that message (same length)
    error: str | None = None

    @property
    def output_tokens(self) -> int:
        return sum(self.chunk_tokens)

    @property
    def ok(self) -> bool:
        return self.error is None and self.output_tokens > 0

    @property
    def latency(self) -> float:
        return self.end_time - self.send_time

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.send_time

    def itls(self) -> list[float]:
        """Per-token gaps after the first message: a message of k tokens after gap g gives k times g/k."""
        out: list[float] = []
        for i in range(1, len(self.chunk_times)):
            k = self.chunk_tokens[i]
            out.extend([(self.chunk_times[i] - self.chunk_times[i - 1]) / k] * k)
        return out

    def tpot(self) -> float | None:
        """Mean time per output token after the first; None for single-token outputs."""
        n = self.output_tokens
        return (self.chunk_times[-1] - self.chunk_times[0]) / (n - 1) if n > 1 else None


def distribution(values: list[float], scale: float = 1000.0) -> dict[str, float]:
    """mean and p50/p90/p99 of ``values`` times ``scale`` (default: seconds -> ms); NaN when empty."""
    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    """The benchmark's numbers over the successful requests; ``duration_s`` is the run's wall time."""
    if not duration_s > 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s}")
    done = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in done)
    in_tokens = sum(r.prompt_len for r in done)
    tpots = [t for r in done if (t := r.tpot()) is not None]
    return {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "short_outputs": sum(1 for r in done if r.output_tokens < r.max_tokens),
        "request_throughput": len(done) / duration_s,
        "output_throughput": out_tokens / duration_s,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s,
        "normalized_latency_s_per_token": (float(np.mean([r.latency / r.output_tokens for r in done]))
                                           if done else float("nan")),
        "ttft_ms": distribution([r.ttft for r in done]),
        "tpot_ms": distribution(tpots),
        "itl_ms": distribution([g for r in done for g in r.itls()]),
        "e2e_latency_ms": distribution([r.latency for r in done]),
        "errors": sorted({r.error for r in results if r.error is not None})[:5],
    }


def format_report(summary: dict, title: str = "Serving benchmark") -> str:
    """A fixed-width text table of :func:`summarize`'s output."""
    rows = [
        ("Successful requests", f"{summary['completed']}"),
        ("Failed requests", f"{summary['failed']}"),
        ("Duration (s)", f"{summary['duration_s']:.2f}"),
        ("Total input tokens", f"{summary['total_input_tokens']}"),
        ("Total output tokens", f"{summary['total_output_tokens']}"),
        ("Request throughput (req/s)", f"{summary['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{summary['output_throughput']:.1f}"),
        ("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.1f}"),
        ("Normalized latency (s/token)", f"{summary['normalized_latency_s_per_token']:.4f}"),
    ]
    for key, name in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
                      ("e2e_latency_ms", "E2E latency")):
        d = summary[key]
        rows.append((f"{name} mean / p50 / p90 / p99 (ms)",
                     " / ".join(f"{d[k]:.1f}" for k in ("mean", "p50", "p90", "p99"))))
    width = max(len(k) for k, _ in rows) + 2
    bar = "=" * (width + 28)
    lines = [bar, title.center(len(bar)), bar]
    lines += [f"{k:<{width}}{v}" for k, v in rows]
    if summary["short_outputs"]:
        lines.append(f"note: {summary['short_outputs']} requests ended before max_tokens (EOS or stop)")
    for err in summary["errors"]:
        lines.append(f"error: {err}")
    lines.append(bar)
    return "\n".join(lines)


# What a side-by-side comparison reports per front: (label, summary key, sub-key or None, format).
COMPARED = (("Output token throughput (tok/s)", "output_throughput", None, "{:.1f}"),
            ("Request throughput (req/s)", "request_throughput", None, "{:.2f}"),
            ("TTFT p50 (ms)", "ttft_ms", "p50", "{:.1f}"), ("TTFT p99 (ms)", "ttft_ms", "p99", "{:.1f}"),
            ("ITL p50 (ms)", "itl_ms", "p50", "{:.1f}"), ("E2E latency p50 (ms)", "e2e_latency_ms", "p50", "{:.1f}"),
            ("Failed requests", "failed", None, "{:d}"))


def compare_runs(runs: dict[str, list[dict]]) -> dict:
    """Per front, the median over its runs of each compared number (and every run's throughput)."""
    out: dict = {}
    for api, summaries in runs.items():
        row = {}
        for _, key, sub, _ in COMPARED:
            values = [s[key][sub] if sub else s[key] for s in summaries]
            row[f"{key}.{sub}" if sub else key] = type(values[0])(np.median(values)) if values else math.nan
        row["output_throughput_runs"] = [s["output_throughput"] for s in summaries]
        out[api] = row
    return out


def format_comparison(comparison: dict, title: str = "Serving benchmark") -> str:
    """The fronts side by side (medians), plus each one's throughput relative to the first."""
    apis = list(comparison)
    width = max(len(label) for label, *_ in COMPARED) + 2
    head = f"{'median of runs':<{width}}" + "".join(f"{a:>14}" for a in apis)
    bar = "=" * len(head)
    lines = [bar, title.center(len(bar)), bar, head]
    for label, key, sub, fmt in COMPARED:
        k = f"{key}.{sub}" if sub else key
        lines.append(f"{label:<{width}}" + "".join(f"{fmt.format(comparison[a][k]):>14}" for a in apis))
    runs = len(comparison[apis[0]]["output_throughput_runs"])
    lines.append(f"{'runs per front':<{width}}{runs:>14}")
    base = comparison[apis[0]]["output_throughput"]
    for a in apis[1:]:
        lines.append(f"{a} output throughput = {comparison[a]['output_throughput'] / base:.3f} x {apis[0]}'s")
    lines.append(bar)
    return "\n".join(lines)


def json_safe(obj):
    """``obj`` with non-finite floats (NaN, inf) as None, so it serializes as strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [json_safe(v) for v in obj]
    return obj
