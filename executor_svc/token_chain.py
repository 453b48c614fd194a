"""A step's greedy tokens kept on the device as the next step's inputs (prepared-ahead decode).

With plans prepared ahead (``pipeline.py``), the step after step k takes the tokens step k samples
as inputs. Read through the host, the device waits between the two: step k's tokens are copied
out, appended, then step k+1's inputs are copied in and it is launched. Where every sampling row
of step k takes its argmax and nothing else (``sampler.samples_the_argmax``), the argmax runs on
the device right after the forward (:func:`greedy_on_device`), its tokens are copied to pinned host
memory behind it, and step k+1 is launched before step k completes, its open input rows filled on
the device from those tokens (:class:`Chain`). The host then reads step k's tokens while step k+1
runs. The tokens are the sampler's: the same argmax of the same logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.batch import Batch
from executor_svc.sampler import greedy_ids, samples_the_argmax


@dataclass(slots=True)
class DeviceTokens:
    """A step's greedy tokens, one per sampling row: on the device, and copied to the host behind
    the argmax (``event`` marks the copy on a GPU)."""

    device: torch.Tensor  # [rows] int64
    host: torch.Tensor
    event: torch.cuda.Event | None = None

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()  # this step's copy only, not the step launched after it
        return self.host.tolist()

    def rows(self, keep: list[int]) -> DeviceTokens:
        """These rows' tokens, on the host only (what completing the step still reads)."""
        host = torch.tensor(self.tolist(), dtype=torch.int64)[keep]
        return DeviceTokens(host, host)


def greedy_on_device(batch: Batch, logits: torch.Tensor) -> DeviceTokens | None:
    """The step's tokens, when its every sampling row takes the argmax of its logits (None: the
    sampler has more to do, on the host)."""
    if batch.spec or batch.prompt_rows or not all(s.grammar is None and samples_the_argmax(s)
                                                  for s in batch.sample_seqs):
        return None
    tokens = greedy_ids(logits)
    if tokens.device.type != "cuda":
        return DeviceTokens(tokens, tokens)
    host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
    host.copy_(tokens, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return DeviceTokens(tokens, host, event)


@dataclass(slots=True)
class Chain:
    """The rows of a batch whose input is a token the step before samples, and the row of that
    step's tokens each takes."""

    rows: list[int]
    src: list[int]
    tokens: torch.Tensor  # the step before's DeviceTokens.device

    @classmethod
    def of(cls, batch: Batch, before: Batch, tokens: DeviceTokens) -> Chain | None:
        """None where an open row's token is not one of ``before``'s sampling rows."""
        where = {id(s): i for i, s in enumerate(before.sample_seqs)}
        rows, src = [], []
        for row, seq, _ in batch.in_flight_inputs:
            i = where.get(id(seq))
            if i is None:
                return None
            rows.append(row)
            src.append(i)
        return cls(rows, src, tokens.device)

    def fill(self, input_ids: torch.Tensor) -> None:
        """Write the tokens into ``input_ids`` (on the device, behind the step before's argmax)."""
        if not self.rows:
            return
        index = torch.tensor([self.rows, self.src], dtype=torch.int64).to(input_ids.device)
        input_ids.index_copy_(0, index[0], self.tokens.index_select(0, index[1]))


def leave_out(step) -> None:
    """``step`` (a runner's ``LaunchedStep``) was launched before the step before it completed, and
    that completion failed sequences ``step`` also runs (``step.leave_out``): their rows ran, but
    report nothing (the scheduler knows them failed). Their K/V went to blocks freed with them."""
    batch, gone = step.batch, step.leave_out
    keep = [i for i, s in enumerate(batch.sample_seqs) if s.seq_id not in gone]
    if len(keep) == len(batch.sample_seqs):
        return
    batch.sample_seqs = [batch.sample_seqs[i] for i in keep]
    batch.logits_rows = [batch.logits_rows[i] for i in keep]
    if step.tokens is not None:
        step.tokens = step.tokens.rows(keep)
    elif step.logits is not None:
        step.logits = step.logits.index_select(0, torch.tensor(keep, dtype=torch.int64, device=step.logits.device))
