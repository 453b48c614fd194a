"""Serving tier capacity: what a front and an engine core cost, each measured as its own process.

Every part runs as a process of its own, and each process's CPU comes from the operating system
(``/proc/<pid>/stat``, ``benchmarks/proc_stat.py``):

- ``python -m scheduler_svc``, the engine core, which starts its ``--api-server-count`` fronts
  itself. The real service rather than the pieces started by hand, so that what is measured is
  what deploys: the fronts' own command line, ports shared with SO_REUSEPORT, the ipc:// tier
  link, uvloop and the collector settings of both;
- one executor: a real ``ExecutorWorker`` (ZeroMQ, handshake, heartbeats) over the simulated
  executor (``benchmarks/engine_harness.py``): it applies the plan deltas and sleeps a constant
  step time (changed between phases), and counts its busy time and each plan's delay (from the
  step before it ending, its result sent, to this plan starting);
- load generators (``benchmarks/tier_load.py``, pagedserve-bench's own senders): 64-token
  prompts, greedy, EOS ignored, every request streaming exactly its tokens; their CPU is
  reported, not counted.

Phases, on one deployment, each ``--repeats`` times (a round runs them one after another):

1. **Cost**: 256 streams of ``--tokens`` through the fronts, gRPC and HTTP alternating, at
   ``--cost-step-ms`` (30: a 70B model's step; at shorter steps this 2-vCPU machine runs short of
   CPU for the clients and the fronts together, and a front that falls behind merges tokens into
   fewer messages, which is no longer the interval-1 cost; tokens per message is reported).
   The fronts' CPU per token = their CPU / the tokens the clients received, the whole run
   (admission and connections included); the core's CPU per step = its CPU / the executor's steps
   in the steady state (every step samples all 256 streams: no admission, no prefill, no ends).
   Each run is followed by the same clients against ``benchmarks/front_floor.py``: grpc.aio and
   uvicorn serving the same calls with none of pagedserve's code, one message per token at the
   same step. Its CPU per token is the frameworks' own cost on this machine, the floor under a
   front's; the front's cost over it is what pagedserve's code adds.
2. **Busy**: 256 gRPC streams of ``--busy-tokens`` at 5 ms steps: the executor's busy fraction
   (its time in steps / the time from its first step's start to its last step's end) with real
   fronts and clients, and each process's share of the machine's CPUs (what limits it); then the
   same with the fronts and the client at ``--busy-nice`` (the core and the executor get the CPU
   first, as where the fronts and clients run on CPUs of their own).
3. **Plan delay**: ``--delay-streams`` background gRPC streams at ``--delay-step-ms``; the largest
   plan delay in a window of ``--baseline-s`` without other requests, then in the window in which
   ``tier_load max-size`` sends one request at each size limit after another; then both again
   with the fronts and the clients at ``--delay-nice``, so that what is left of a delay is the
   core's own loop rather than this machine's 2 vCPUs shared with them; with
   ``--each-max-request`` also a window per request (which one delays the plans).
4. **Intervals** (not run unless named): a front's own CPU per token by ``--stream-interval``
   (``--intervals``), gRPC and HTTP, in this process over an engine that ticks
   (``testing/ticking_engine.py``): no core, no executor, no other process sharing the CPU.
5. **APIs** (not run unless named): the HTTP front against gRPC on a real model (``--model``, a
   CPU executor): throughput, latencies and the scheduler's CPU per token of each
   (``benchmarks/tier_apis.py``).

``scheduler_overhead``'s ``ms_per_step_256`` is measured in the same run (before and after, the
median): the targets hold at 0.35 ms and scale by reference / 0.35 on a slower machine. That
reference runs its steps back to back; the engine core's come one per ``--cost-step-ms``, after an
idle wait, and a step on cold caches costs more CPU (2-3.5x on the development VM). So the same
step is also measured after such a gap (``reference_schedule_ms_256_after_gap``): the core's CPU
per step over it is what the engine core adds to the scheduler's own work under equal conditions.

    .venv/bin/python -m benchmarks.tier_capacity [--quick] [--repeats 3] [--phases cost,busy,delay]
    .venv/bin/python -m benchmarks.tier_capacity --phases intervals [--intervals 1,4]
    .venv/bin/python -m benchmarks.tier_capacity --phases apis [--model DIR] [--repeats 7]

Prints a table (a row per window: CPU per token and per step, busy fraction, plan delays, and the
CPUs each process used, with the rest of the machine's as "others"), each target against its
value, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks import tier_apis
from benchmarks.scheduler_overhead import measure as schedule_cost
from benchmarks.tier_processes import (
    NUM_BLOCKS,
    SEQS,
    Deployment,
    Floor,
    deployment,
    floor_server,
    plan_delays,
    run_floor,
    run_streams,
)
from testing.ticking_engine import front_costs

REFERENCE_MS = 0.35  # scheduler_overhead's ms_per_step_256 on the machine the targets were set on
TARGETS = {"front_cpu_us_per_token_grpc": 20.0, "front_cpu_us_per_token_http": 12.0,
           "core_cpu_ms_per_step_256": 0.8, "max_plan_delay_ms_max_request": 5.0}


def reference_ms(repeats: int, gap_s: float = 0.0, steps: int = 64) -> list[float]:
    """scheduler_overhead's ms_per_step_256, ``repeats`` times (``gap_s``: each step after an idle
    gap that long, as the engine core's steps come)."""
    return [schedule_cost(SEQS, steps, gap_s)[0] for _ in range(repeats)]


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "?")
    flags = Path("/proc/cpuinfo").read_text()
    return f"{model}, {os.cpu_count()} vCPUs, {'AVX-512' if 'avx512f' in flags else 'no AVX-512'}"


def _median(rows: list[dict], key: str) -> float:
    values = [r[key] for r in rows if key in r and math.isfinite(r[key])]
    return statistics.median(values) if values else float("nan")


COLUMNS = (  # (key, heading, format)
    ("label", "run", "{:<28}"), ("seqs_per_step", "seq/step", "{:>8.0f}"),
    ("tokens_per_message", "tok/msg", "{:>7.2f}"), ("front_us_per_token", "front us/tok", "{:>12.1f}"),
    ("core_ms_per_step", "core ms/step", "{:>12.3f}"), ("busy", "busy", "{:>6.3f}"),
    ("max_delay_ms", "max delay ms", "{:>12.2f}"), ("delays_over_5ms", ">5ms", "{:>5d}"),
    ("client_us_per_token", "client us/tok", "{:>13.1f}"), ("cpus_core", "CPUs: core", "{:>10.2f}"),
    ("cpus_fronts", "fronts", "{:>6.2f}"), ("cpus_executor", "exec", "{:>5.2f}"), ("cpus_client", "client", "{:>6.2f}"),
    ("cpus_others", "others", "{:>6.2f}"), ("cpus_stolen", "stolen", "{:>6.2f}"))


def print_table(rows: list[dict]) -> None:
    def width(fmt: str) -> int:
        return int(fmt[3:].split(".")[0].rstrip("d}"))

    print(" ".join(f"{head:<{width(fmt)}}" if key == "label" else f"{head:>{width(fmt)}}"
                   for key, head, fmt in COLUMNS))
    for r in rows:
        print(" ".join(fmt.format(r[key]) if key in r else " " * width(fmt) for key, _, fmt in COLUMNS), flush=True)


PHASES = ("cost", "busy", "delay", "intervals", "apis")
TIER_PHASES = {"cost", "busy", "delay"}  # the phases on the deployment (the default)
# The maximum-size requests of tier_load that reach the core (the two at a transport bound are refused by the front).
MAX_REQUESTS = ("grpc token ids", "http token ids", "http text", "grpc every limit")


@dataclass
class Results:
    cost: dict[str, list[dict]] = field(default_factory=lambda: {"grpc": [], "http": []})
    floor: dict[str, list[dict]] = field(default_factory=lambda: {"grpc": [], "http": []})
    busy: list[dict] = field(default_factory=list)
    busy_nice: list[dict] = field(default_factory=list)
    delays: list[tuple[dict, dict]] = field(default_factory=list)
    delays_nice: list[tuple[dict, dict]] = field(default_factory=list)
    rows: list[dict] = field(default_factory=list)


def run_phases(dep: Deployment, floor: Floor | None, a: argparse.Namespace, phases: set[str]) -> Results:
    """Each phase ``a.repeats`` times, the phases of a round one after another (the APIs alternate);
    ``floor``: the frameworks alone, run after each API's cost run."""
    r, seed = Results(), 0
    for rep in range(a.repeats):
        if "cost" in phases:
            for api in (("grpc", "http") if rep % 2 == 0 else ("http", "grpc")):
                seed += 1
                r.cost[api].append(run_streams(dep, api, SEQS, a.tokens, a.cost_step_ms / 1e3,
                                               f"{api} {a.cost_step_ms:g} ms", seed))
                r.rows.append(r.cost[api][-1])
                if floor is not None:
                    r.floor[api].append(run_floor(floor, api, SEQS, a.tokens, dep.vocab,
                                                  f"{api} floor {a.cost_step_ms:g} ms", seed))
                    r.rows.append(r.floor[api][-1])
        if "busy" in phases:
            seed += 1
            r.busy.append(run_streams(dep, "grpc", SEQS, a.busy_tokens, 0.005, "grpc 5 ms", seed))
            r.rows.append(r.busy[-1])
            if a.busy_nice:
                seed += 1
                r.busy_nice.append(run_streams(dep, "grpc", SEQS, a.busy_tokens, 0.005,
                                               f"grpc 5 ms, fronts nice {a.busy_nice}", seed, nice=a.busy_nice))
                r.rows.append(r.busy_nice[-1])
        if "delay" in phases:
            seed += 1
            base, big, alone = plan_delays(dep, a.delay_streams, a.delay_step_ms / 1e3, a.baseline_s, 1, seed,
                                           MAX_REQUESTS if a.each_max_request else ())
            base["label"], big["label"] = f"delay: {a.delay_streams} streams", "delay: + max-size requests"
            for w in alone:
                w["label"] = f"delay: + {w['label']}"
            r.rows += [base, big, *alone]
            r.delays.append((base, big))
            if a.delay_nice:
                seed += 1
                base, big, _ = plan_delays(dep, a.delay_streams, a.delay_step_ms / 1e3, a.baseline_s, 1, seed,
                                           nice=a.delay_nice)
                base["label"] = f"delay: {a.delay_streams} streams, nice {a.delay_nice}"
                big["label"] = f"delay: + max-size, nice {a.delay_nice}"
                r.rows += [base, big]
                r.delays_nice.append((base, big))
    return r


def summarize(r: Results, ref: float) -> dict:
    """The JSON keys (the issue's first, then what explains them); a phase not run gives none."""
    out: dict = {}
    if r.cost["grpc"]:
        out["front_cpu_us_per_token_grpc"] = _median(r.cost["grpc"], "front_us_per_token")
        out["front_cpu_us_per_token_http"] = _median(r.cost["http"], "front_us_per_token")
        out["core_cpu_ms_per_step_256"] = _median(r.cost["grpc"] + r.cost["http"], "core_ms_per_step")
    for api in ("grpc", "http"):
        if r.floor[api]:
            out[f"front_floor_us_per_token_{api}"] = _median(r.floor[api], "front_us_per_token")
            out[f"front_over_floor_us_per_token_{api}"] = statistics.median(  # each run against its own floor
                c["front_us_per_token"] - f["front_us_per_token"] for c, f in zip(r.cost[api], r.floor[api], strict=True))
    if r.delays:
        out["max_plan_delay_ms_max_request"] = statistics.median(b["max_delay_ms"] for _, b in r.delays)
    if r.cost["grpc"]:
        out["capacity_tok_s_per_front"] = 1e6 / out["front_cpu_us_per_token_grpc"]
        out["capacity_tok_s_per_front_http"] = 1e6 / out["front_cpu_us_per_token_http"]
        out["capacity_tok_s_per_engine_core"] = SEQS * 1e3 / out["core_cpu_ms_per_step_256"]
    if r.busy:
        out["busy_5ms_256_through_fronts"] = _median(r.busy, "busy")
    out["reference_schedule_ms_256"] = ref
    if r.cost["grpc"]:
        out["tokens_per_message_grpc"] = _median(r.cost["grpc"], "tokens_per_message")
        out["tokens_per_message_http"] = _median(r.cost["http"], "tokens_per_message")
    if r.busy:
        out["busy_5ms_256_steady"] = _median(r.busy, "busy_steady")
        out["core_cpu_ms_per_step_256_at_5ms"] = _median(r.busy, "core_ms_per_step")
        out["front_cpu_us_per_token_grpc_at_5ms"] = _median(r.busy, "front_us_per_token")
        out["tokens_per_message_grpc_at_5ms"] = _median(r.busy, "tokens_per_message")
        out["machine_cpus_busy_at_5ms"] = _median(r.busy, "cpus_machine")
    if r.busy_nice:
        out["busy_5ms_256_fronts_niced"] = _median(r.busy_nice, "busy")
    if r.delays:
        out["max_plan_delay_ms_baseline"] = statistics.median(b["max_delay_ms"] for b, _ in r.delays)
    if r.delays_nice:
        out["max_plan_delay_ms_max_request_niced"] = statistics.median(b["max_delay_ms"] for _, b in r.delays_nice)
        out["max_plan_delay_ms_baseline_niced"] = statistics.median(b["max_delay_ms"] for b, _ in r.delays_nice)
    if r.delays:
        out["max_request_outcomes"] = sorted({f"{s['name']}: {s['outcome'][:40]}" for _, b in r.delays
                                              for s in b["sent"]})
    return out


MODEL_STEPS_MS = (5, 15, 30)
HEADROOM = 0.7  # plan a process at 70% of its CPU: one at 100% falls behind (a front merges, a core's plans wait)


def print_capacity_model(summary: dict) -> None:
    """Fronts and engine cores per executor (256 sequences decoding each step), from the measured costs."""
    if "core_cpu_ms_per_step_256" not in summary:
        return
    front = {api: summary[f"front_cpu_us_per_token_{api}"] for api in ("grpc", "http")}
    core = summary["core_cpu_ms_per_step_256"]
    print(f"\ncapacity model (one executor, {SEQS} sequences per step; each process planned at {HEADROOM:.0%} "
          f"of a CPU):")
    print(f"{'step ms':>7} {'tokens/s':>9} {'gRPC: front CPUs':>16} {'fronts':>6} {'HTTP: front CPUs':>16} {'fronts':>6} "
          f"{'core CPUs':>9} {'executors per core':>18}")
    for step in MODEL_STEPS_MS:
        tok_s = SEQS * 1e3 / step
        cpus = {api: tok_s * us / 1e6 for api, us in front.items()}
        print(f"{step:>7} {tok_s:>9.0f} {cpus['grpc']:>16.2f} {cpus['grpc'] / HEADROOM:>6.2f} "
              f"{cpus['http']:>16.2f} {cpus['http'] / HEADROOM:>6.2f} {core / step:>9.3f} "
              f"{HEADROOM * step / core:>18.1f}")


def report_targets(summary: dict, refs: list[float]) -> float:
    """Print each target against its value, scaled to this machine; return the scale."""
    ref = statistics.median(refs)
    scale = max(1.0, ref / REFERENCE_MS)
    print(f"\nreference (scheduler_overhead ms_per_step_256): median {ref:.3f} ms of {len(refs)} "
          f"({min(refs):.3f}-{max(refs):.3f}); targets scale by {scale:.2f}")
    for key, target in TARGETS.items():
        if key in summary:
            value, bound = summary[key], target * scale
            print(f"  {key:<32} {value:>9.3f}  target <= {bound:.3f}  {'met' if value <= bound else 'MISSED'}")
    if "reference_schedule_ms_256_after_gap" in summary:
        print(f"  engine core: the scheduler's own step after the same idle gap costs "
              f"{summary['reference_schedule_ms_256_after_gap']:.3f} ms here (back to back: {ref:.3f}); the core's "
              f"CPU per step is {summary['core_over_reference_after_gap']:.2f}x that")
    for api in ("grpc", "http"):
        if f"front_floor_us_per_token_{api}" in summary:
            print(f"  {api} front: the frameworks alone cost {summary[f'front_floor_us_per_token_{api}']:.1f} µs per "
                  f"token here; pagedserve adds {summary[f'front_over_floor_us_per_token_{api}']:.1f}")
    return scale


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="one round, fewer tokens, a shorter baseline")
    ap.add_argument("--repeats", type=int, default=3, help="rounds of the phases (medians are reported)")
    ap.add_argument("--phases", default="cost,busy,delay", help=f"which of {','.join(PHASES)} to run")
    ap.add_argument("--fronts", type=int, default=1, help="--api-server-count")
    ap.add_argument("--stream-interval", type=int, default=1, help="the scheduler's --stream-interval")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per stream in the cost phase")
    ap.add_argument("--busy-tokens", type=int, default=1024, help="tokens per stream in the busy phase")
    ap.add_argument("--busy-nice", type=int, default=10,
                    help="the busy phase again with the fronts and the client at this niceness (0: not)")
    ap.add_argument("--cost-step-ms", type=float, default=30.0)
    ap.add_argument("--no-floor", dest="floor", action="store_false",
                    help="leave out the frameworks-alone runs (benchmarks/front_floor.py) of the cost phase")
    ap.add_argument("--delay-step-ms", type=float, default=5.0)
    ap.add_argument("--delay-streams", type=int, default=64)
    ap.add_argument("--baseline-s", type=float, default=5.0, help="the plan-delay phase's window without them")
    ap.add_argument("--delay-nice", type=int, default=10,
                    help="the delay phase again with the fronts and clients at this niceness (0: not run)")
    ap.add_argument("--each-max-request", action="store_true",
                    help="the delay phase also sends each maximum-size request alone, a window each (which one "
                         "delays the plans)")
    ap.add_argument("--max-model-len", type=int, default=131072, help="the simulated executor's context")
    ap.add_argument("--intervals", default="1,4", help="the intervals phase's --stream-interval values")
    ap.add_argument("--interval-tokens", type=int, default=200, help="tokens per stream in the intervals phase")
    tier_apis.add_args(ap)
    a = ap.parse_args(argv)
    phases = set(a.phases.split(","))
    if not phases <= set(PHASES):
        ap.error(f"--phases: choose among {','.join(PHASES)}, got {a.phases!r}")
    if a.quick:
        a.repeats, a.tokens, a.busy_tokens, a.baseline_s, a.interval_tokens = 1, 128, 256, 2.0, 64
        vars(a).update(tier_apis.QUICK)
    print(f"machine: {machine()}; load average {os.getloadavg()[0]:.2f}", flush=True)
    summary = run_tier(a, phases) if phases & TIER_PHASES else {}
    if "intervals" in phases:
        for api in ("grpc", "http"):
            costs = front_costs(api, [int(k) for k in a.intervals.split(",")], SEQS, a.interval_tokens, a.repeats)
            print(f"{api} front in process: " + ", ".join(f"{k} {v}" for k, v in costs.items()), flush=True)
            summary |= {f"{k}_{api}": v for k, v in costs.items()}
        summary |= {"intervals": a.intervals, "interval_tokens": a.interval_tokens}
    if "apis" in phases:
        summary |= tier_apis.measure(a) | {"model": str(a.model), "api_requests": a.num_requests,
                                           "api_concurrency": a.concurrency}
    summary |= {"repeats": a.repeats, "machine": machine(), "load_average": os.getloadavg()[0]}
    print(json.dumps({k: (round(v, 4) if math.isfinite(v) else None) if isinstance(v, float) else v
                      for k, v in summary.items()}))


def run_tier(a: argparse.Namespace, phases: set[str]) -> dict:
    """The phases on the deployment (cost, busy, delay), with the reference and the targets."""
    refs = reference_ms(10 if a.quick else 15)
    gap_refs = reference_ms(2 if a.quick else 4, a.cost_step_ms / 1e3, 32) if "cost" in phases else []
    with tempfile.TemporaryDirectory(prefix="tier-capacity-") as tmp, \
            deployment(Path(tmp), a.fronts, a.max_model_len, NUM_BLOCKS, a.stream_interval) as dep, \
            (floor_server(a.cost_step_ms / 1e3) if "cost" in phases and a.floor else contextlib.nullcontext()) as floor:
        for api in ("grpc", "http"):  # warm both fronts' paths (first requests import and compile)
            run_streams(dep, api, 16, 16, 0.005, "warm-up", seed=99)
        results = run_phases(dep, floor, a, phases)
    print_table(results.rows)
    refs += reference_ms(10 if a.quick else 15)
    if gap_refs:
        gap_refs += reference_ms(len(gap_refs), a.cost_step_ms / 1e3, 32)
    summary = summarize(results, statistics.median(refs))
    if gap_refs and "core_cpu_ms_per_step_256" in summary:
        summary["reference_schedule_ms_256_after_gap"] = statistics.median(gap_refs)
        summary["core_over_reference_after_gap"] = summary["core_cpu_ms_per_step_256"] / statistics.median(gap_refs)
    print_capacity_model(summary)
    summary["target_scale"] = report_targets(summary, refs)
    return summary | {"fronts": a.fronts, "stream_interval": a.stream_interval, "streams": SEQS,
                      "tokens_per_stream": a.tokens, "cost_step_ms": a.cost_step_ms,
                      "busy_tokens_per_stream": a.busy_tokens, "delay_step_ms": a.delay_step_ms,
                      "delay_streams": a.delay_streams}


if __name__ == "__main__":
    main()
