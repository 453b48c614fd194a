"""The records of a step between the runner's phases (``runner.py``): what ``prepare`` hands to
``launch``, and what ``launch`` hands to ``complete`` while the forward may still run."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.batch import Batch, SeqState
from executor_svc.grammar import GrammarMasks
from executor_svc.lora.served import LoraOutcome
from executor_svc.token_chain import DeviceTokens
from pagedserve.wire import BatchPlan


class StepFatal(RuntimeError):
    """An error the runner must not survive (a broken tensor-parallel group): no phase turns it
    into a failed step; it ends the process."""


@dataclass(slots=True)
class PreparedStep:
    """A plan checked and applied, its batch built: what ``ModelRunner.launch`` starts."""

    plan: BatchPlan  # as applied (entries naming dropped sequences left out)
    batch: Batch | None  # None: nothing scheduled
    start: float  # when its preparation began
    lora: LoraOutcome | None = None  # its LoRA loads that failed and the sequences dropped for them


@dataclass(slots=True)
class LaunchedStep:
    """A step whose forward has been started (on a GPU it may still be running)."""

    plan: BatchPlan
    batch: Batch | None
    logits: torch.Tensor | None
    start: float  # when it was launched: its model_seconds run from here (its preparation overlapped)
    masks: GrammarMasks | None = None  # the constrained rows' token masks, filled while the forward runs
    lora: LoraOutcome | None = None
    tokens: DeviceTokens | None = None  # its greedy tokens taken on the device (token_chain.py)
    leave_out: frozenset[int] = frozenset()  # sequences that step's completion failed: they report nothing here

    def sampling_seqs(self) -> dict[int, SeqState]:
        """The sequences that get a token when this step completes (beam rows get none)."""
        if self.batch is None or self.logits is None:
            return {}
        return {s.seq_id: s for s in self.batch.token_seqs()}
