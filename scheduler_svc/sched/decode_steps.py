"""How many decode steps the next plan of one executor takes (``BatchPlan.decode_steps``).

Where a decode step is short (a small model on a CPU: 1-6 ms), what every plan costs besides the
forward (building, sending and checking it, applying its result, one message per front and per
client stream) is a large share of a token's time; a plan of k decode steps pays it once for k
tokens. Where a step is long that cost is small, and k steps would only make tokens stream in
bursts and an arrival wait longer. So a plan takes as many steps as last ``DECODE_PLAN_S`` at the
decode step time the executor's results report, at most what it serves, and only when nothing
else needs a plan of its own (docs/ARCHITECTURE.md, "Several decode steps per plan").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.wire import StepResult

if TYPE_CHECKING:
    from scheduler_svc.sched.in_flight import InFlight
    from scheduler_svc.sched.lifecycle import RequestLifecycle

# A plan of several decode steps lasts at most about this long: at the ~1 ms of CPU a plan costs over
# the serving path, several steps where steps are a few milliseconds, one where a step is this long.
DECODE_PLAN_S = 0.025
_STEP_TIME_WEIGHT = 0.2  # of the newest decode step's time in the running estimate


class DecodeStepPolicy:
    def __init__(self, most: int) -> None:
        self.most = most  # what the executor serves (SchedulerConfig.decode_steps)
        self.step_s: float | None = None  # the executor's decode step, as its results report it

    def observe(self, step: InFlight, result: StepResult) -> None:
        """A served result: a plan of decodes only says how long a decode step takes."""
        if step.decode_only and result.model_seconds > 0:
            t, old = result.model_seconds / step.decode_steps, self.step_s
            self.step_s = t if old is None else old + _STEP_TIME_WEIGHT * (t - old)

    def choose(self, sched: RequestLifecycle) -> int:
        """Up to ``most`` steps, as many as last ``DECODE_PLAN_S``, when every running request is one
        resident sequence decoding plainly (no beams, log-probs, structured output or prompt scores),
        nothing waits or is swapped out (admission would wait for the whole plan), every sequence has
        that many tokens left (no plan computes past its length), and the free blocks hold what they
        write; else 1. Before a step time is known (the first plan of decodes measures it): 1."""
        if self.most < 2 or self.step_s is None or sched.waiting or sched.swapped or not sched.running:
            return 1
        k = min(self.most, int(DECODE_PLAN_S / max(self.step_s, 1e-6)))
        if k < 2:
            return 1
        kv, need = sched.kv, 0
        for r in sched.running:
            live = r.live
            if len(live) != 1 or r.beam is not None or not r.forked:
                return 1
            seq = live[0]
            sp = seq.sampling
            if not seq.resident or sp.want_logprobs or sp.structured is not None or sp.prompt_logprobs >= 0:
                return 1
            total = len(seq.token_ids) + seq.num_placeholders
            if total - seq.num_computed_tokens != 1:
                return 1  # a prompt still to compute
            if r.stop_len - total < k:
                k = r.stop_len - total
                if k < 2:
                    return 1
            need += kv.blocks_needed(seq, k)
        return k if need <= kv.num_free_blocks else 1
