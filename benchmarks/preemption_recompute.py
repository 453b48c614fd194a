"""What preemption by recompute costs when the KV pool cannot hold the requests it admitted.

Requests of one size arrive together, more than the pool holds to their end (by default 4
requests of 6,000 prompt tokens and 2,000 output tokens, EOS ignored, in a pool of 23,200 token
slots: 2.9 of them), through the real :class:`Scheduler` driven by :class:`SimExecutor` in virtual
time (OPT-13B step costs, ``testing/sim/executor.py``), one plan at a time and, as the engine's
loop runs, with the next plan built while one is in flight. With and without prefix caching:
without it, a preempted request recomputes all it had; with it, what it had is found in the cache
unless the others' growth evicted it. Reported per case: preemptions, tokens the executor
computed per token the requests needed (prompt and output once each: 1.0 is no waste), steps and
virtual seconds until all ended.

Usage::

    python -m benchmarks.preemption_recompute [--requests 4] [--prompt 6000] [--output 2000] [--pool-tokens 23200]
"""

from __future__ import annotations

import argparse
import json

from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.wire import SamplingParams
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing.sim.executor import SimExecutor

BLOCK = 16


def run_case(requests: int, prompt: int, output: int, pool_tokens: int, caching: bool, depth: int) -> dict:
    """All requests at time 0; ``depth`` plans in flight (2: the engine's asynchronous loop)."""
    cfg = SchedulerConfig(block_size=BLOCK, max_model_len=prompt + output + BLOCK, enable_prefix_caching=caching)
    sched = Scheduler(cfg, pool_tokens // BLOCK, 0, ())
    for i in range(requests):
        sched.add_request(GenerationRequest(f"r{i}", [(i * 7919 + j * 31) % 50000 + 4 for j in range(prompt)],
                                            RequestParams(max_tokens=output, ignore_eos=True,
                                                          sampling=SamplingParams(temperature=0.0))))
    executor = SimExecutor(eos_token_id=None)
    computed, steps, seconds, got = 0, 0, 0.0, dict.fromkeys(range(requests), 0)
    sent: list = []
    while sched.has_work() or sent:
        while len(sent) < depth and (plan := sched.schedule()) is not None:
            sent.append(plan)
        if not sent:
            raise RuntimeError("the scheduler has work but plans nothing")
        plan = sent.pop(0)
        result = executor.execute(plan)
        computed += sum(plan.num_new_tokens)
        steps += bool(plan.scheduled_seq_ids)
        seconds += result.model_seconds
        for update in sched.update(result):
            got[int(update.request_id[1:])] += sum(len(s.new_token_ids) for s in update.seqs)
        sched.check_integrity()
    assert all(n == output for n in got.values()), f"a request did not get all its tokens: {got}"
    assert sched.block_stats()["used"] == 0, "blocks leaked"
    return {"depth": depth, "caching": caching, "preemptions": sched.num_preemptions,
            "computed_per_needed": round(computed / (requests * (prompt + output)), 3),
            "steps": steps, "virtual_s": round(seconds, 2)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.preemption_recompute", description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=6000, help="prompt tokens per request")
    ap.add_argument("--output", type=int, default=2000, help="output tokens per request")
    ap.add_argument("--pool-tokens", type=int, default=23200, help="KV token slots (blocks of 16)")
    args = ap.parse_args(argv)
    rows = [run_case(args.requests, args.prompt, args.output, args.pool_tokens, caching, depth)
            for depth in (1, 2) for caching in (False, True)]
    print(f"{args.requests} requests of {args.prompt} + {args.output} tokens, a pool of {args.pool_tokens} tokens")
    print("| plans in flight | prefix caching | preemptions | tokens computed / needed | steps | virtual s |")
    print("|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['depth']} | {'on' if r['caching'] else 'off'} | {r['preemptions']} | "
              f"{r['computed_per_needed']:.2f} | {r['steps']} | {r['virtual_s']:.1f} |")
    out = {}
    for r in rows:
        tag = f"{'cached' if r['caching'] else 'uncached'}_depth{r['depth']}"
        out |= {f"preemptions_{tag}": r["preemptions"], f"computed_per_needed_{tag}": r["computed_per_needed"],
                f"virtual_s_{tag}": r["virtual_s"]}
    print(json.dumps(out | {"requests": args.requests, "prompt": args.prompt, "output": args.output,
                            "pool_tokens": args.pool_tokens}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
