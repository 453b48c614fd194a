"""What does the serving tier deliver when the executor's step is as short as a GPU's?

    .venv/bin/python -m benchmarks.stack_ceiling [--step-ms 1.0,1.5] [--streams 1,64,256] [--tokens 128]
        [--repeats 3] [--fronts 2] [--clients 4]

The whole-stack targets of issue #45 (>= 400 tokens/s for one stream and >= 25,000 for 64, gRPC
streams of 128 tokens on a 1.1B-shaped Llama) assume a decode step of at most 1.0 ms at one
sequence and 1.5 ms at 64 (CUDA graphs). Whether the host side can keep that pace is a question
for the CPUs alone: this benchmark starts the real service (``python -m scheduler_svc``: engine
core and ``--fronts`` gRPC fronts) and one simulated executor process whose steps take exactly
``--step-ms`` (``benchmarks/tier_processes.py``), and streams greedy requests of ``--tokens``
tokens (64-token prompts, EOS ignored) from ``--clients`` client processes, as ``make gpu-check``'s
whole-stack figure does on a GPU (``testing/stack_throughput.py``). On a machine with fewer cores
than processes, the figure is the machine's: the table prints how busy the executor was.

Tokens per second count from the first request sent to the last token received. The fronts' and
the engine core's CPU per token (from ``/proc``) say what the tier streams where each of its
processes has a core of its own (``own_cores_tok_s``), as on a GPU host. Each figure's own
reference is the ideal of the same run: ``streams / step`` tokens per second, a stream gaining one
token per step with no time between steps; ``of_ideal`` is the share reached. Medians over
``--repeats`` rounds. The last line is the JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path

from benchmarks import engine_harness as h
from benchmarks.tier_processes import Window, deployment
from pagedserve.bench.loadgen import fixed_trace
from testing.stack_throughput import Clients

PROMPT = 64

TARGETS = {(1.0, 1): 400.0, (1.5, 64): 25_000.0}  # (step ms, streams): tokens/s of #45's whole-stack bars


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.stack_ceiling", description=__doc__.split("\n")[0])
    ap.add_argument("--step-ms", default="1.0,1.5", help="the simulated executor's step times")
    ap.add_argument("--streams", default="1,64,256", help="concurrent streams per round")
    ap.add_argument("--tokens", type=int, default=128, help="tokens per stream")
    ap.add_argument("--repeats", type=int, default=3, help="rounds per configuration (the median is reported)")
    ap.add_argument("--fronts", type=int, default=2, help="the service's --api-server-count")
    ap.add_argument("--clients", type=int, default=4, help="client processes sharing the streams")
    a = ap.parse_args(argv)
    steps = [float(x) for x in a.step_ms.split(",")]
    streams = [int(x) for x in a.streams.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as d, deployment(Path(d), fronts=a.fronts, max_model_len=4096,
                                                        num_blocks=1 << 15) as dep:
        pool = Clients(dep.grpc_target, a.clients)
        try:
            def trace(n: int, tokens: int, seed: int) -> list:
                return fixed_trace(n, (PROMPT, PROMPT), (tokens, tokens), math.inf, seed, dep.vocab)

            def one(n: int, seed: int) -> tuple[float, float, float, float]:
                """tokens/s, executor busy, and the fronts' and the core's CPU µs per token."""
                dep.zero_stats()
                before = dep.snapshot()
                tok_s = pool.round(trace(n, a.tokens, seed))
                after, st = dep.snapshot(), dep.read_stats()
                w = Window(before, after, st)
                per_token = 1e6 / (n * a.tokens)
                return (tok_s, st[h.BUSY_S] / max(1e-9, st[h.LAST_END] - st[h.FIRST_START]),
                        w.cpu("fronts") * per_token, w.cpu("core") * per_token)

            dep.step_time.value = steps[0] / 1e3
            pool.round(trace(max(streams), 16, 99))  # warm-up
            for step_ms in steps:
                dep.step_time.value = step_ms / 1e3
                for n in streams:
                    runs = [one(n, r) for r in range(a.repeats)]
                    tok_s = statistics.median(r[0] for r in runs)
                    ideal = n / (step_ms / 1e3)
                    front_us, core_us = (statistics.median(r[k] for r in runs) for k in (2, 3))
                    rows.append({"step_ms": step_ms, "streams": n, "tok_s": round(tok_s), "ideal_tok_s": round(ideal),
                                 "of_ideal": round(tok_s / ideal, 3), "busy": round(statistics.median(r[1] for r in runs), 3),
                                 "front_us_per_token": round(front_us, 1), "core_us_per_token": round(core_us, 1),
                                 # what the tier could stream with a core for each front and for the core
                                 "own_cores_tok_s": round(min(a.fronts * 1e6 / front_us, 1e6 / core_us)),
                                 "target_tok_s": TARGETS.get((step_ms, n))})
                    r = rows[-1]
                    print(f"step {step_ms:4.1f} ms, {n:4d} streams: {r['tok_s']:8d} tok/s ({100 * r['of_ideal']:.0f}% of "
                          f"{r['ideal_tok_s']}), executor busy {r['busy']:.2f}; CPU per token: fronts {front_us:.1f} µs, "
                          f"core {core_us:.1f} µs (a core each: {r['own_cores_tok_s']} tok/s)", flush=True)
        finally:
            pool.close()
    out = {f"tok_s_{r['step_ms']}ms_s{r['streams']}": r["tok_s"] for r in rows}
    out |= {f"of_ideal_{r['step_ms']}ms_s{r['streams']}": r["of_ideal"] for r in rows}
    out |= {f"{k}_{r['step_ms']}ms_s{r['streams']}": r[k] for r in rows
            for k in ("front_us_per_token", "core_us_per_token", "own_cores_tok_s")}
    out["meets_targets"] = all(r["tok_s"] >= r["target_tok_s"] for r in rows if r["target_tok_s"])
    out |= {"tokens": a.tokens, "repeats": a.repeats, "fronts": a.fronts, "clients": a.clients}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
