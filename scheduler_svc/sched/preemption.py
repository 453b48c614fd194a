"""Preemption and swapping: taking running requests off the device when blocks run short, and
bringing swapped ones back.

A running request that cannot get its blocks preempts the latest-arrived running request (it
may be itself), as a whole: swapped out to the CPU pool (``preemption_mode="swap"`` and room
there) or dropped for recompute (its blocks freed, back at the head of the waiting queue, its
LoRA slot given up), until it fits. In a step where nobody was preempted, swapped requests come
back first come first served while the device keeps its watermark of blocks free. A request
whose sample is still in flight is not brought back until that result came.
"""

from __future__ import annotations

from pagedserve.wire import BatchPlan
from scheduler_svc.sched.plan_building import PlanBuilding, StepBudget
from scheduler_svc.sched.request import Request, RequestState


class Preemption(PlanBuilding):
    """Preemption (swap or recompute) and swap-in, mixed into ``Scheduler``."""

    def _schedule_with_preemption(self, r: Request, plan: BatchPlan, budget: StepBudget) -> bool:
        """Schedule ``r``, preempting the latest arrivals while blocks are short.

        Returns False when ``r`` itself had to be preempted.
        """
        work = self._group_work(r, budget)
        if not work:
            return True
        intros = self._intros(r)
        changes = self._allocate(work, 0)
        while changes is None:
            victim = self.running[-1]
            self._preempt(victim, plan)
            self._preempted = True
            if victim is r:
                return False
            changes = self._allocate(work, 0)
        self._emit(work, changes, intros, plan, budget)
        return True

    def _preempt(self, r: Request, plan: BatchPlan) -> None:
        """Take the whole request off the device: swap (if asked and room) or recompute."""
        self.running.remove(r)
        self.num_preemptions += 1
        pairs = None
        if self.config.preemption_mode == "swap":
            pairs = self.kv.swap_out(r.live)
        if pairs is not None:
            plan.swap_out.extend(pairs)
            r.state = RequestState.SWAPPED
            self.swapped.appendleft(r)
            for seq in r.live:
                if seq.resident:
                    self._owed_frees.append(seq.seq_id)
                seq.forget_executor_state()
            return
        for seq in r.live:
            self._forget(seq)
            seq.num_computed_tokens = 0
        self.unpin_lora(r)  # (recomputed later, perhaps under another slot)
        r.state = RequestState.WAITING
        self.waiting.appendleft(r)

    def _schedule_swapped(self, plan: BatchPlan, budget: StepBudget) -> None:
        while self.swapped and budget.tokens > 0:
            r = self.swapped[0]
            if awaits_result(r):
                return
            try:
                if not self._swap_in(r, plan, budget):
                    return
            except Exception as exc:  # noqa: BLE001  one request's failure must not reach the others
                self._isolate(r, plan, exc)

    def _swap_in(self, r: Request, plan: BatchPlan, budget: StepBudget) -> bool:
        pairs = self.kv.swap_in(r.live, reserve=self._watermark)
        if pairs is None:
            return False
        self.swapped.popleft()
        plan.swap_in.extend(pairs)
        self._set_running(r)
        work = self._group_work(r, budget)
        if work:
            intros = self._intros(r)
            changes = self._allocate(work, self._watermark)
            if changes is not None:
                self._emit(work, changes, intros, plan, budget)
        return True


def awaits_result(r: Request) -> bool:
    """A preempted request whose sample is still in flight: (re)admit it once that result came."""
    return any(s.num_placeholders for s in r.live)
