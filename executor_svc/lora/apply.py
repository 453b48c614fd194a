"""The LoRA wrapper around each projection: ``y = base(x) + delta`` for the tokens of each slot.

Whatever module computes a projection (``nn.Linear``, or on the CPU a ``PackedLinear`` /
``BlockLinear`` on the C kernels) stays as it is and is wrapped; attributes the rest of the
executor reads on it (``desc()`` for the fused decode stack, ``fmt``, ``ops``) pass through.

A step's adapters come from a :class:`LoraBatch` (one slot per token, -1: the base model) that
:class:`~executor_svc.lora.manager.LoraManager` puts on the shared :class:`LoraState` for the
forward. Its groups (the rows of each slot) are computed once per step, not per layer; a step
without adapter tokens sets none, and each wrapper then costs one attribute check.

Per group the delta is two small matrix products, ``(x_g A^T) B^T``, added with ``index_add_``
into the output columns the slot's adapter touches. Measured against a per-token ``bmm`` over
gathered A/B (benchmarks/lora_delta_cpu.py): the grouped products are faster on the CPU (the
gather copies each token's A and B, larger than the token itself), so they are kept.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from executor_svc.lora.adapter import LoraError
from executor_svc.lora.slots import FUSED, LoraSlots, ProjectionSlots


@dataclass(frozen=True, slots=True)
class LoraBatch:
    """One step's adapter per token: ``token_slots`` [num_tokens] int64, -1 = the base model.
    ``groups``: (slot, its rows, or None when the slot has every row of the step)."""

    token_slots: torch.Tensor
    groups: tuple[tuple[int, torch.Tensor | None], ...]

    @classmethod
    def build(cls, token_slots: torch.Tensor, loaded: list[bool], device: torch.device) -> LoraBatch | None:
        """The step's groups; None when no token uses an adapter (the wrappers then add nothing).
        A token naming an empty or unknown slot is an error, never served by the base model silently."""
        slots = torch.as_tensor(token_slots, dtype=torch.int64).flatten().cpu()
        if slots.numel() == 0 or bool((slots < 0).all()):
            return None
        used = [int(s) for s in torch.unique(slots[slots >= 0])]
        bad = [s for s in used if s >= len(loaded) or not loaded[s]]
        if bad:
            raise LoraError(f"LoRA batch: token(s) use slot(s) {bad} that hold no adapter")
        if len(used) == 1 and bool((slots == used[0]).all()):
            return cls(slots, ((used[0], None),))
        groups = tuple((s, (slots == s).nonzero().flatten().to(device)) for s in used)
        return cls(slots, groups)


class LoraState:
    """Shared by every wrapper of one model: the current step's batch (None outside a step or
    when the step has no adapter tokens), and the slots. The model reads it too
    (``LlamaForCausalLM.lora``): the fused C decode stack, which bypasses the modules, adds the
    step's deltas itself from the same slot tensors (``csrc/lora_cpu.c``)."""

    def __init__(self, slots: LoraSlots | None = None) -> None:
        self.batch: LoraBatch | None = None
        self.slots = slots


class LoraLinear(nn.Module):
    """A projection plus the LoRA deltas of the current step's slots."""

    def __init__(self, base: nn.Module, slots: ProjectionSlots, state: LoraState) -> None:
        super().__init__()
        self.base = base
        self.slots, self.state = slots, state

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("base", "_modules"):
                raise
            return getattr(self._modules["base"], name)  # desc(), fmt, ops, weight, ...

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        batch = self.state.batch
        if batch is None:
            return y
        return add_delta(x, y, self.slots, batch)


def add_delta(x: torch.Tensor, y: torch.Tensor, p: ProjectionSlots, batch: LoraBatch) -> torch.Tensor:
    """``y`` [n, out] plus each group's ``(x_g A^T) B^T`` in its output columns, in float32 (y in place
    when it is float32)."""
    out = y if y.dtype == torch.float32 else y.to(torch.float32)
    out2, x2 = out.view(-1, out.shape[-1]), x.reshape(-1, x.shape[-1])
    if x2.dtype != torch.float32:
        x2 = x2.to(torch.float32)
    for slot, rows in batch.groups:
        used = p.used[slot]
        if used == 0:  # (this adapter leaves this projection of this layer alone)
            continue
        lo, hi = p.lo[slot], p.hi[slot]
        a, bt = p.a[slot, :used], p.bt[slot, :used, lo:hi]  # (bt's rows strided by out: BLAS takes it as it is)
        if a.dtype != torch.float32:  # bfloat16 slots: widened exactly, the decode kernel's values
            a, bt = a.float(), bt.float()
        if rows is None:  # the slot has every row: accumulate in place, no gather
            out2[:, lo:hi].addmm_(torch.mm(x2, a.t()), bt)
        else:
            u = torch.mm(x2.index_select(0, rows), a.t())
            out2[:, lo:hi].index_add_(0, rows, torch.mm(u, bt))
    return out if out is y else out.to(y.dtype)


def install(model, slots: LoraSlots, state: LoraState) -> None:
    """Wrap the four projections of every layer of ``model`` and point the model at ``state``."""
    if getattr(model, "lora", None) is not None:
        raise LoraError("this model already has a LoraManager (one per model)")
    for layer, projections in zip(model.layers, slots.layers, strict=True):
        for name, (parent, _) in FUSED.items():
            owner = getattr(layer, parent)
            setattr(owner, name, LoraLinear(getattr(owner, name), projections[name], state))
    state.slots = slots
    model.lora = state
