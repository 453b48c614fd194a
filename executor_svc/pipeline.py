"""The executor's one loop over plans: each step through the runner's three phases, in order,
each plan prepared on the host while the device runs the one before when that overlaps.

``worker.ComputeThread`` pushes every plan into a :class:`StepPipeline` and sends what comes
out. Without ``ahead`` (depth 0: on CPU, where nothing overlaps, and under tensor parallelism)
each plan runs to its end when it comes: ``ModelRunner.execute``, the three phases back to back,
once per decode step. With ``ahead`` (depth 1; asynchronous scheduling keeps the next plan
queued before a step ends, and a sequential runner would leave the device idle while its thread
checks and applies that plan and builds its batch):

1. launch step k (its forward is queued on the device; on CPU it runs here);
2. when plan k+1 is already here: prepare it (check, apply, build). Where step k's
   sampled token is an input of k+1, the row is left open;
3. complete step k (the sampler waits for its forward) and report it;
4. launch step k+1, its open rows filled from the tokens step k appended.

Results come out in plan order, and the tokens are the same as with the sequential
runner (tests/unit/executor/test_step_pipeline.py). A plan that forks or extends a sequence (n > 1
choices, beam search's chosen tokens) needs step k's token on the host first: step k
completes before it is prepared. When step k fails for some sequences, step k+1 is
launched without them (``ModelRunner.launch`` rebuilds its batch), as the sequential
runner would have skipped them: the other sequences of k+1 are served.

On a GPU, step 2 runs while the device computes step k. On CPU nothing overlaps (the
forward runs in step 1), so the executor prepares ahead only on CUDA devices
(``ModelRunner.prepare_ahead``); the tests run it on CPU for its exactness.

Where step k's every row is greedy, steps 3 and 4 swap (``chain``): step k's tokens are taken on
the device at its launch, step k+1 is launched with its open rows filled there, and step k
completes while step k+1 runs, so the device does not wait for the host between them
(executor_svc/token_chain.py). A sequence that step k's completion drops then ran in step k+1:
that step reports nothing of it.
"""

from __future__ import annotations

from executor_svc.runner import LaunchedStep, ModelRunner
from pagedserve.wire import BatchPlan, StepResult


class StepPipeline:
    def __init__(self, runner: ModelRunner, ahead: bool = True, chain: bool = True) -> None:
        """``chain`` (with ``ahead``): greedy tokens stay on the device as the next step's inputs,
        and that step is launched before the one in flight completes (executor_svc/token_chain.py)."""
        self.runner, self.ahead, self.chain = runner, ahead, ahead and chain
        self.in_flight: LaunchedStep | None = None  # launched, not yet completed (never without ahead)
        self.chained = 0  # steps launched before the step before them completed

    def push(self, plan: BatchPlan) -> list[StepResult]:
        """Start ``plan``; the results completed meanwhile (the step before it), oldest first.
        Without ``ahead``: ``plan``'s own result, its steps all run."""
        runner, done = self.runner, []
        if not self.ahead:
            return [runner.execute(plan)]
        if self.in_flight is not None and not runner.can_prepare_ahead(plan):
            done.append(self.finish())
        prepared = runner.prepare(plan, self.in_flight)
        launched = None
        if self.in_flight is not None:
            if self.chain and not isinstance(prepared, StepResult):
                launched = runner.launch_chained(prepared, self.in_flight)
            done.append(self.finish())
            if isinstance(launched, LaunchedStep) and done[-1].failed_seq_ids:
                launched.leave_out = frozenset(done[-1].failed_seq_ids)
        if isinstance(prepared, StepResult):  # refused or failed while being prepared
            done.append(prepared)
            return done
        if launched is None:
            launched = runner.launch(prepared, tokens_on_device=self.chain)
        else:
            self.chained += 1
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
