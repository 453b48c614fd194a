"""Run plans in order, preparing each one on the host while the device runs the one before.

With asynchronous scheduling the next plan is queued before a step ends. A
sequential runner still leaves the device idle between two steps while its thread
checks and applies the next plan and builds its batch. :class:`StepPipeline` does that
work while the step before is in flight, in this order:

1. launch step k (its forward is queued on the device; on CPU it runs here);
2. when plan k+1 is already here: prepare it (check, apply, build). Where step k's
   sampled token is an input of k+1, the row is left open;
3. complete step k (the sampler waits for its forward) and report it;
4. launch step k+1, its open rows filled from the tokens step k appended.

Results come out in plan order, and the tokens are the same as with the sequential
runner (tests/test_step_pipeline.py). A plan that forks or extends a sequence (n > 1
choices, beam search's chosen tokens) needs step k's token on the host first: step k
completes before it is prepared. When step k fails for some sequences, step k+1 is
launched without them (``ModelRunner.launch`` rebuilds its batch), as the sequential
runner would have skipped them: the other sequences of k+1 are served.

On a GPU, step 2 runs while the device computes step k. On CPU nothing overlaps (the
forward runs in step 1), so the executor's compute thread uses this only on CUDA
devices; the tests run it on CPU for its exactness.
"""

from __future__ import annotations

from executor_svc.runner import LaunchedStep, ModelRunner
from pagedserve.wire import BatchPlan, StepResult


class StepPipeline:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.in_flight: LaunchedStep | None = None  # launched, not yet completed

    def push(self, plan: BatchPlan) -> list[StepResult]:
        """Start ``plan``; the results completed meanwhile (the step before it), oldest first."""
        runner, done = self.runner, []
        if self.in_flight is not None and not runner.can_prepare_ahead(plan):
            done.append(self.finish())
        prepared = runner.prepare(plan, self.in_flight)
        if self.in_flight is not None:
            done.append(self.finish())
        if isinstance(prepared, StepResult):  # refused or failed while being prepared
            done.append(prepared)
            return done
        launched = runner.launch(prepared)
        if isinstance(launched, StepResult):
            done.append(launched)
        else:
            self.in_flight = launched
        return done

    def finish(self) -> StepResult:
        """Complete the step in flight (there must be one)."""
        step, self.in_flight = self.in_flight, None
        assert step is not None
        return self.runner.complete(step)
