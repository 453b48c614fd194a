"""The LoRA wrapper around each projection: ``y = base(x) + delta`` for the tokens of each slot.

Whatever module computes a projection (``nn.Linear``, or on the CPU a ``PackedLinear`` /
``BlockLinear`` on the C kernels) stays as it is and is wrapped; attributes the rest of the
executor reads on it (``desc()`` for the fused decode stack, ``fmt``, ``ops``) pass through.

A step's adapters come from a :class:`LoraBatch` (one slot per token, -1: the base model) that
:class:`~executor_svc.lora.manager.LoraManager` puts on the shared :class:`LoraState` for the
forward. Its groups (the rows of each slot) are computed once per step, not per layer; a step
without adapter tokens sets none, and each wrapper then costs one attribute check.

On the CPU, per group the delta is two small matrix products, ``(x_g A^T) B^T``, added with
``index_add_`` into the output columns the slot's adapter touches. Measured against a per-token
``bmm`` over gathered A/B (benchmarks/lora_delta_cpu.py): the grouped products are faster on the
CPU (the gather copies each token's A and B, larger than the token itself), so they are kept.

On CUDA the deltas are the batched kernels of ``cupy_kernels/lora.cu`` (``LoraState.kernels``):
a shrink ``t = x A[slot]^T`` and an expand ``y[:, lo:hi] += t B[slot]^T`` over every token of the
step, one launch each per projection whatever the number of adapters (a group's torch products
would be two launches per adapter, plus the gather and the ``index_add_``). Each token's sums
run in one fixed order, whatever else is in the step.
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
    device_slots: torch.Tensor | None = None  # [num_tokens] int32 on the model's device: the kernels' input

    @classmethod
    def build(cls, token_slots: torch.Tensor, loaded: list[bool], device: torch.device,
              with_kernels: bool = False) -> LoraBatch | None:
        """The step's groups; None when no token uses an adapter (the wrappers then add nothing).
        A token naming an empty or unknown slot is an error, never served by the base model silently.
        ``with_kernels``: the step runs the batched kernels, which read ``device_slots`` and need no
        group rows."""
        slots = torch.as_tensor(token_slots, dtype=torch.int64).flatten().cpu()
        if slots.numel() == 0 or bool((slots < 0).all()):
            return None
        used = [int(s) for s in torch.unique(slots[slots >= 0])]
        bad = [s for s in used if s >= len(loaded) or not loaded[s]]
        if bad:
            raise LoraError(f"LoRA batch: token(s) use slot(s) {bad} that hold no adapter")
        device_slots = slots.to(torch.int32).to(device) if with_kernels else None
        if len(used) == 1 and bool((slots == used[0]).all()):
            return cls(slots, ((used[0], None),), device_slots)
        rows = (lambda s: None) if with_kernels else (lambda s: (slots == s).nonzero().flatten().to(device))
        return cls(slots, tuple((s, rows(s)) for s in used), device_slots)


class LoraState:
    """Shared by every wrapper of one model: the current step's batch (None outside a step or
    when the step has no adapter tokens), and the slots. The model reads it too
    (``LlamaForCausalLM.lora``): the fused C decode stack, which bypasses the modules, adds the
    step's deltas itself from the same slot tensors (``csrc/lora_cpu.c``)."""

    def __init__(self, slots: LoraSlots | None = None, kernels=None) -> None:
        self.batch: LoraBatch | None = None
        self.slots = slots
        # The batched kernels (``shrink``/``expand``: cupy_kernels.lora on CUDA, set by install; the
        # CPU emulator in tests); None: the groups' torch products.
        self.kernels = kernels


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
        return self.add_lora(x, self.base(x))

    def add_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (the base projection of ``x``) plus this step's deltas. The model's row-parallel layers
        call it on their partial product, before the sum over ranks and the bias (llama.py,
        ``_row_parallel``), so the all-reduce sums the ranks' deltas as it sums the base."""
        batch = self.state.batch
        if batch is None:
            return y
        if self.state.kernels is not None:
            return add_delta_kernels(x, y, self.slots, batch, self.state.kernels)
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


def add_delta_kernels(x: torch.Tensor, y: torch.Tensor, p: ProjectionSlots, batch: LoraBatch, kernels) -> torch.Tensor:
    """``y`` [n, out] plus every token's delta, in place, through the batched kernels: the expand's grid
    spans the widest output range among the step's slots that touch this projection."""
    live = [p.hi[s] - p.lo[s] for s, _ in batch.groups if p.used[s]]
    if not live:  # (no adapter of the step touches this projection of this layer)
        return y
    x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
    if x2.shape[1] > 1 and x2.stride(1) != 1:
        x2 = x2.contiguous()
    t = torch.empty(x2.shape[0], p.a.shape[1], dtype=torch.float32, device=x2.device)  # [n, R]
    kernels.shrink(t, x2, p.a, p.device_bounds, batch.device_slots)
    kernels.expand(y2, t, p.bt, p.device_bounds, batch.device_slots, max(live))
    return y


def cuda_kernels():
    """The batched LoRA kernels on CUDA (imported only there: CuPy exists only on GPU machines)."""
    from cupy_kernels import lora

    return lora


def install(model, slots: LoraSlots, state: LoraState) -> None:
    """Wrap the four projections of every layer of ``model`` and point the model at ``state``; on
    CUDA the deltas go through the batched kernels unless ``state`` names others."""
    if getattr(model, "lora", None) is not None:
        raise LoraError("this model already has a LoraManager (one per model)")
    if state.kernels is None and model.device.type == "cuda":
        state.kernels = cuda_kernels()
    for layer, projections in zip(model.layers, slots.layers, strict=True):
        for name, (parent, _) in FUSED.items():
            owner = getattr(layer, parent)
            setattr(owner, name, LoraLinear(getattr(owner, name), projections[name], state))
    state.slots = slots
    model.lora = state
