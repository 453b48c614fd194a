"""CPU cost of the scheduler's hot path per decode step, and plan size on the wire.

For 64, 256 and 1024 running decode sequences, one step is timed as the
scheduler side of an iteration: ``schedule()`` + ``plan.encode(plan)`` +
``plan.decode(result_frame)`` + ``update(result)``. The executor's part
(decoding the plan, encoding its StepResult) is done outside the timer.
Each measurement averages 64 steps; the script repeats it and reports the
median, because the machine is shared and noisy.

    .venv/bin/python -m benchmarks.scheduler_overhead [--repeats 5] [--steps 64]

The last line printed is JSON with ``ms_per_step_{N}`` and
``bytes_per_seq_step_{N}`` for each N.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from scheduler_svc import plan as wire
from scheduler_svc.api_types import GenerationRequest, RequestParams
from scheduler_svc.plan import BatchPlan, SamplingParams, StepResult
from scheduler_svc.sched_config import SchedulerConfig
from scheduler_svc.scheduler import Scheduler

EOS = 2


def _respond(plan: BatchPlan, tokens: dict[int, int], computed: dict[int, int]) -> StepResult:
    """A trivial executor: tracks counts and samples token 7 (never EOS) where due."""
    for ns in plan.new_seqs:
        tokens[ns.seq_id] = len(ns.token_ids)
        computed[ns.seq_id] = ns.num_computed_tokens
    ids = []
    for sid, n in zip(plan.scheduled_seq_ids, plan.num_new_tokens, strict=True):
        computed[sid] += n
        if computed[sid] == tokens[sid]:
            tokens[sid] += 1
            ids.append(sid)
    return StepResult(plan.step_id, ids, [7] * len(ids))


def _setup(num_seqs: int) -> tuple[Scheduler, dict[int, int], dict[int, int]]:
    cfg = SchedulerConfig(max_num_seqs=num_seqs, max_num_batched_tokens=max(2048, num_seqs),
                          max_model_len=4096)
    sched = Scheduler(cfg, num_device_blocks=num_seqs * 40, num_cpu_blocks=0, eos_token_id=EOS)
    rng = random.Random(num_seqs)
    for i in range(num_seqs):
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(20, 200))]
        sched.add_request(GenerationRequest(f"req-{i}", prompt, RequestParams(
            max_tokens=100_000 // 40, sampling=SamplingParams(temperature=0.0))))
    tokens: dict[int, int] = {}
    computed: dict[int, int] = {}
    while sched.num_waiting or any(computed.get(s, 0) < tokens.get(s, 1) - 1 for s in sched.seqs):
        plan = sched.schedule()
        sched.update(_respond(plan, tokens, computed))  # type: ignore[arg-type]
    return sched, tokens, computed


def measure(num_seqs: int, steps: int) -> tuple[float, float]:
    """(ms per step, plan bytes per sequence per step) over ``steps`` decode steps."""
    sched, tokens, computed = _setup(num_seqs)
    gc.collect()
    busy = 0.0
    nbytes = 0
    for _ in range(steps):
        t0 = time.perf_counter()
        plan = sched.schedule()
        frame = wire.encode(plan)  # type: ignore[arg-type]
        t1 = time.perf_counter()
        result_frame = wire.encode(_respond(wire.decode(frame), tokens, computed))  # type: ignore[arg-type]
        t2 = time.perf_counter()
        sched.update(wire.decode(result_frame))  # type: ignore[arg-type]
        t3 = time.perf_counter()
        busy += (t1 - t0) + (t3 - t2)
        nbytes += len(frame)
        if len(plan.scheduled_seq_ids) != num_seqs:  # type: ignore[union-attr]
            raise RuntimeError("benchmark invariant: every sequence decodes every step")
    return busy / steps * 1e3, nbytes / steps / num_seqs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    args = ap.parse_args()
    out: dict[str, float] = {}
    for n in args.sizes:
        runs = [measure(n, args.steps) for _ in range(args.repeats)]
        ms = statistics.median(r[0] for r in runs)
        nb = statistics.median(r[1] for r in runs)
        print(f"{n:5d} decode seqs: {ms:.3f} ms/step (runs: "
              f"{', '.join(f'{r[0]:.3f}' for r in runs)}), {nb:.2f} plan bytes/seq/step")
        out[f"ms_per_step_{n}"] = round(ms, 4)
        out[f"bytes_per_seq_step_{n}"] = round(nb, 3)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
