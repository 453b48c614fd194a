"""CPU cost of the scheduler's hot path per decode step, and plan size on the wire.

For 64, 256 and 1024 running decode sequences, one step is timed as the
scheduler side of an iteration: ``schedule()`` + the bound of its result
(``max_result_bytes``) + ``wire.encode(plan)`` + ``wire.decode(result_frame)``
+ ``update(result)``. The executor's part
(decoding the plan, encoding its StepResult) is done outside the timer.
Each measurement averages 64 steps; the script repeats it and reports the
median, because the machine is shared and noisy. ``ms_per_step_N`` is the
thread's CPU time (what the scheduler costs); ``wall_ms_per_step_N`` is
wall-clock time, which on a loaded machine also counts other processes.

    .venv/bin/python -m benchmarks.scheduler_overhead [--repeats 5] [--steps 64] [--gap-ms 30]

The last line printed is JSON with ``ms_per_step_{N}`` and
``bytes_per_seq_step_{N}`` for each N, ``ms_per_step_blocked_32k`` and ``ms_per_step_ngram_24x8k``
(n-gram speculation's lookups, below).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import random
import statistics
import time

from pagedserve import wire
from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.kv_blocks import hash_blocks
from pagedserve.wire import BatchPlan, SamplingParams, StepResult
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from scheduler_svc.sched.speculation import SpeculativeConfig

EOS = 2


def respond(plan: BatchPlan, tokens: dict[int, int], computed: dict[int, int]) -> StepResult:
    """A trivial executor: tracks counts (forks copy their parent's) and samples token 7 (never
    EOS) where due."""
    for ns in plan.new_seqs:
        tokens[ns.seq_id] = ns.num_tokens
        computed[ns.seq_id] = ns.num_computed_tokens
    for f in plan.forks:
        tokens[f.child_seq_id] = tokens[f.parent_seq_id]
        computed[f.child_seq_id] = computed[f.parent_seq_id]
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
    sched = Scheduler(cfg, num_device_blocks=num_seqs * 40, num_cpu_blocks=0, eos_token_ids=(EOS,))
    rng = random.Random(num_seqs)
    for i in range(num_seqs):
        prompt = [rng.randrange(100, 30000) for _ in range(rng.randint(20, 200))]
        sched.add_request(GenerationRequest(f"req-{i}", prompt, RequestParams(
            max_tokens=100_000 // 40, sampling=SamplingParams(temperature=0.0))))
    tokens: dict[int, int] = {}
    computed: dict[int, int] = {}
    while sched.num_waiting or any(computed.get(s, 0) < tokens.get(s, 1) - 1 for s in sched.seqs):
        plan = sched.schedule()
        sched.update(respond(plan, tokens, computed))  # type: ignore[arg-type]
    return sched, tokens, computed


def measure(num_seqs: int, steps: int, gap_s: float = 0.0) -> tuple[float, float, float]:
    """(CPU ms per step, wall ms per step, plan bytes per sequence per step) over ``steps`` steps.

    CPU time (``time.thread_time``) is the scheduler's own cost; wall time also
    counts whatever else the shared machine ran meanwhile. ``gap_s``: the thread sleeps this long
    before each step, as a service waits for its executor's step; the step then starts on cold
    caches (and, on a VM, a vCPU the host may have descheduled), which costs CPU too.
    """
    sched, tokens, computed = _setup(num_seqs)
    gc.collect()
    cpu = wall = 0.0
    nbytes = 0
    for _ in range(steps):
        if gap_s:
            time.sleep(gap_s)
        c0, t0 = time.thread_time(), time.perf_counter()
        plan = sched.schedule()
        sched.in_flight[-1].max_result_bytes()  # what the engine sends with the plan (the result's bound)
        frame = wire.encode(plan)  # type: ignore[arg-type]
        c1, t1 = time.thread_time(), time.perf_counter()
        result_frame = wire.encode(respond(wire.decode(frame), tokens, computed))  # type: ignore[arg-type]
        c2, t2 = time.thread_time(), time.perf_counter()
        sched.update(wire.decode(result_frame))  # type: ignore[arg-type]
        c3, t3 = time.thread_time(), time.perf_counter()
        cpu += (c1 - c0) + (c3 - c2)
        wall += (t1 - t0) + (t3 - t2)
        nbytes += len(frame)
        if len(plan.scheduled_seq_ids) != num_seqs:  # type: ignore[union-attr]
            raise RuntimeError("benchmark invariant: every sequence decodes every step")
    return cpu / steps * 1e3, wall / steps * 1e3, nbytes / steps / num_seqs


def measure_blocked_head(steps: int) -> float:
    """CPU ms of ``schedule()`` per step while a 32K-token prompt waits at the head of the queue:
    seven running requests (4K-token prompts, the first 4K tokens of its own, so it has ~256
    cached blocks to hit) leave too few blocks for its first chunk, and it is retried every
    step. Its prompt hashes are precomputed, as the engine does when it routes a request."""
    cfg = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=8192, max_model_len=40_000)
    sched = Scheduler(cfg, num_device_blocks=2200, num_cpu_blocks=0, eos_token_ids=(EOS,))

    def request(rid: str, n: int, max_tokens: int) -> GenerationRequest:
        return GenerationRequest(rid, list(range(10, 10 + n)), RequestParams(
            max_tokens=max_tokens, sampling=SamplingParams(temperature=0.0), ignore_eos=True))

    for i in range(7):
        sched.add_request(request(f"running-{i}", 4096, 2_000))
    big = request("waiting-32k", 32_768, 8)
    big.prompt_block_hashes = hash_blocks(None, big.prompt_token_ids, cfg.block_size)
    sched.add_request(big)
    tokens: dict[int, int] = {}
    computed: dict[int, int] = {}
    for _ in range(8):  # the running requests' prefill
        sched.update(respond(sched.schedule(), tokens, computed))  # type: ignore[arg-type]
    gc.collect()
    cpu = 0.0
    for _ in range(steps):
        c0 = time.thread_time()
        plan = sched.schedule()
        cpu += time.thread_time() - c0
        sched.update(respond(plan, tokens, computed))  # type: ignore[arg-type]
    if sched.num_waiting != 1:
        raise RuntimeError("benchmark invariant: the 32K-token request waits throughout")
    return cpu / steps * 1e3


def measure_ngram_lookup(steps: int, seqs: int = 24, prompt: int = 8192) -> float:
    """CPU ms of ``schedule()`` + ``update()`` per step with n-gram speculation on and two plans in
    flight (asynchronous scheduling), while ``seqs`` sequences of ``prompt`` distinct tokens decode
    tokens never seen before: nothing matches, so no sequence is ever paused and each looks its
    whole context up every step (``SpeculativeSteps.waits``): the lookup's worst case."""
    cfg = SchedulerConfig(max_num_seqs=seqs, max_num_batched_tokens=8192, max_model_len=prompt + 1024,
                          speculative=SpeculativeConfig(num_speculative_tokens=4))
    sched = Scheduler(cfg, num_device_blocks=seqs * (prompt // 16 + 80), num_cpu_blocks=0, eos_token_ids=(EOS,),
                      vocab_size=1 << 30)
    for i in range(seqs):
        sched.add_request(GenerationRequest(f"req-{i}", list(range(100 + i * prompt, 100 + (i + 1) * prompt)),
                                            RequestParams(max_tokens=1000, sampling=SamplingParams(temperature=0.0),
                                                          ignore_eos=True)))
    tokens: dict[int, int] = {}
    computed: dict[int, int] = {}
    fresh = itertools.count(1 << 24)
    plans: list[BatchPlan] = []

    def step() -> None:
        while len(plans) < 2 and (plan := sched.schedule()) is not None:
            plans.append(plan)
        done = respond(plans.pop(0), tokens, computed)
        sched.update(StepResult(done.step_id, done.sampled_seq_ids, [next(fresh) for _ in done.sampled_seq_ids]))

    while sched.num_waiting or any(computed.get(s, 0) < prompt for s in sched.seqs):  # the prefill
        step()
    gc.collect()
    c0 = time.thread_time()
    for _ in range(steps):
        step()
    return (time.thread_time() - c0) / steps * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--sizes", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--gap-ms", type=float, default=0.0,
                    help="sleep this long before each step (an idle wait for the executor, as in a service)")
    args = ap.parse_args()
    out: dict[str, float] = {}
    for n in args.sizes:
        runs = [measure(n, args.steps, args.gap_ms / 1e3) for _ in range(args.repeats)]
        cpu = statistics.median(r[0] for r in runs)
        wall = statistics.median(r[1] for r in runs)
        nb = statistics.median(r[2] for r in runs)
        print(f"{n:5d} decode seqs: {cpu:.3f} CPU ms/step (runs: {', '.join(f'{r[0]:.3f}' for r in runs)}); "
              f"wall {wall:.3f} ms; {nb:.2f} plan bytes/seq/step")
        out[f"ms_per_step_{n}"] = round(cpu, 4)
        out[f"wall_ms_per_step_{n}"] = round(wall, 4)
        out[f"bytes_per_seq_step_{n}"] = round(nb, 3)
    runs = [measure_blocked_head(args.steps) for _ in range(args.repeats)]
    blocked = statistics.median(runs)
    print(f"32K-token prompt waiting for blocks behind 7 running: {blocked:.3f} CPU ms/step "
          f"(runs: {', '.join(f'{r:.3f}' for r in runs)})")
    out["ms_per_step_blocked_32k"] = round(blocked, 4)
    runs = [measure_ngram_lookup(args.steps) for _ in range(args.repeats)]
    ngram = statistics.median(runs)
    print(f"n-gram speculation, 24 sequences of 8K tokens, nothing matching: {ngram:.3f} CPU ms/step "
          f"(runs: {', '.join(f'{r:.3f}' for r in runs)})")
    out["ms_per_step_ngram_24x8k"] = round(ngram, 4)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
