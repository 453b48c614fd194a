"""Fixed adapter slots: per layer and fused projection, every slot's A and B in one stacked tensor.

Our model fuses q/k/v into ``qkv_proj`` and gate/up into ``gate_up_proj`` (loader.py), so an
adapter's sub-projections share one slot entry: their A matrices are stacked along the rank axis
(A [slots, subs * max_rank, in]: the input is read once per group) and B is block-diagonal,
stored transposed (``bt`` [slots, subs * max_rank, out]: each sub's columns in its slice of the
fused output, scaling folded in; transposed so that a slot's used block is a plain strided
matrix for BLAS, where [out, used] of [out, max_rank] made torch copy it at every call). A slot's used rank columns are packed at the front (``used``) and the outputs it
touches form one range (``lo``, ``hi``), so a step computes ``(x A[:used]^T) bt[:used, lo:hi]``
and nothing for the padding. Absent sub-projections, layers and slots are zeros: an unloaded
slot has ``used == 0`` and costs nothing.

The slot tensors are float32 (exact against PEFT's float32 products) or bfloat16 (``dtype``):
half the bytes the fused decode stack reads per step (csrc/lora_cpu.c widens them exactly and
sums in float32; the torch products of prefill steps widen them too, so both paths compute
with the same values). bfloat16 slots round A and B^T (its scaling folded in) once, when written:
a rounding PEFT's float32 products do not make, so float32 is this class's default (the
executor's ``--lora-dtype auto`` picks bfloat16 on CPU).

Each slot also records its sub-projections' segments (``segs``: rank rows and the output columns
they touch) so that the decode kernel reads only the non-zero blocks of the block-diagonal B.

Memory is preallocated at ``max_rank`` (as vLLM does): about
``bytes x max_loras x max_rank x (subs x in + out)`` per projection and layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor_svc.lora.adapter import MAX_RANK, LoraAdapter, LoraError, module_shape
from executor_svc.model.architecture import ModelConfig

DTYPES = (torch.float32, torch.bfloat16)  # what slot tensors may hold (PS_LORA_F32 / PS_LORA_BF16)
MAX_SEGS = 3  # PS_LORA_MAX_SEGS: the most sub-projections a fused projection has

# fused projection -> (its parent module in a layer, its HF sub-projections in output order)
FUSED: dict[str, tuple[str, tuple[str, ...]]] = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}


@dataclass(slots=True)
class ProjectionSlots:
    """One fused projection of one layer, every slot; see the module doc."""

    subs: dict[str, tuple[int, int]]  # HF module -> (first output row in the fused output, rows)
    a: torch.Tensor  # [slots, subs * max_rank, in] float32 or bfloat16
    bt: torch.Tensor  # [slots, subs * max_rank, out], a's dtype: B^T, scaling folded in
    used: list[int]  # per slot: rank columns in use (0: nothing to add)
    lo: list[int]  # per slot: first output row touched
    hi: list[int]  # per slot: one past the last output row touched
    # [slots, MAX_SEGS, 4] int32: per sub-projection present, (first rank row, end row, first output,
    # end output), as the C decode stack reads them; rows (0, 0) end a slot's list
    segs: torch.Tensor | None = None
    bounds: torch.Tensor | None = None  # [3, slots] int32 (used, lo, hi), as the CUDA kernels read them
    device_bounds: torch.Tensor | None = None  # the same on the slots' device (the CUDA kernels'); on CPU: bounds

    def __post_init__(self) -> None:
        self.segs = torch.zeros(len(self.used), MAX_SEGS, 4, dtype=torch.int32)
        self.bounds = torch.zeros(3, len(self.used), dtype=torch.int32)
        self.device_bounds = self.bounds if self.a.device.type == "cpu" else self.bounds.to(self.a.device)

    def _sync(self, slot: int) -> None:
        self.bounds[:, slot] = torch.tensor([self.used[slot], self.lo[slot], self.hi[slot]], dtype=torch.int32)
        if self.device_bounds is not self.bounds:  # (loads run between steps, on the compute stream)
            self.device_bounds.copy_(self.bounds)

    def desc(self):
        """The C view (``ps_lora_t``) of these slots: pointers into tensors this object keeps."""
        from executor_svc.cpu_ops import LoraDesc

        return LoraDesc(self.a.data_ptr(), self.bt.data_ptr(), self.segs.data_ptr(), self.a.shape[0],
                        self.a.shape[1], self.a.shape[2], self.bt.shape[2], DTYPES.index(self.a.dtype), 0)

    @classmethod
    def empty(cls, cfg: ModelConfig, modules: tuple[str, ...], max_loras: int, max_rank: int,
              device: torch.device, dtype: torch.dtype = torch.float32) -> ProjectionSlots:
        subs, start = {}, 0
        for m in modules:
            out, n_in = module_shape(cfg, m)
            subs[m] = (start, out)
            start += out
        width = len(modules) * max_rank
        return cls(subs, torch.zeros(max_loras, width, n_in, device=device, dtype=dtype),
                   torch.zeros(max_loras, width, start, device=device, dtype=dtype),
                   [0] * max_loras, [0] * max_loras, [0] * max_loras)

    def clear(self, slot: int) -> None:
        used = self.used[slot]
        if used:
            self.a[slot, :used].zero_()
            self.bt[slot, :used].zero_()
        self.used[slot] = self.lo[slot] = self.hi[slot] = 0
        self.segs[slot].zero_()
        self._sync(slot)

    def write(self, slot: int, pieces: dict[str, tuple[torch.Tensor, torch.Tensor]], scaling: float) -> None:
        """Slot ``slot`` holds ``pieces`` (HF module -> (A [r, in], B [out, r])) and nothing else."""
        self.clear(slot)
        col, lo, hi, segs = 0, None, 0, []
        for module, (start, rows) in self.subs.items():  # (output order: lo/hi bound a range)
            if module not in pieces:
                continue
            a, b = pieces[module]
            r = a.shape[0]
            self.a[slot, col:col + r] = a  # (rounded once here when the slots are bfloat16)
            self.bt[slot, col:col + r, start:start + rows] = b.t() * scaling
            segs.append((col, col + r, start, start + rows))
            col += r
            lo = start if lo is None else lo
            hi = start + rows
        self.used[slot], self.lo[slot], self.hi[slot] = col, lo or 0, hi
        if segs:
            self.segs[slot, :len(segs)] = torch.tensor(segs, dtype=torch.int32)
        self._sync(slot)


class LoraSlots:
    """``max_loras`` slots (0..max_loras-1) for adapters of rank <= ``max_rank`` on ``model``'s layers:
    ``layers[i][fused name]`` is a :class:`ProjectionSlots`. On a tensor-parallel rank ``model.cfg``
    is the rank's own, and so are the slots' shapes: adapters arrive already sharded."""

    def __init__(self, model, max_loras: int, max_rank: int, dtype: torch.dtype = torch.float32) -> None:
        if not isinstance(max_loras, int) or max_loras < 1:
            raise LoraError(f"max_loras must be a positive integer, got {max_loras!r}")
        if not isinstance(max_rank, int) or not 1 <= max_rank <= MAX_RANK:
            raise LoraError(f"max_rank must be an integer in [1, {MAX_RANK}], got {max_rank!r}")
        if dtype not in DTYPES:
            raise LoraError(f"LoRA slot dtype must be float32 or bfloat16, got {dtype}")
        self.cfg: ModelConfig = model.cfg
        self.max_loras, self.max_rank, self.dtype = max_loras, max_rank, dtype
        device = model.device
        self.layers: list[dict[str, ProjectionSlots]] = [
            {name: ProjectionSlots.empty(self.cfg, subs, max_loras, max_rank, device, dtype)
             for name, (_, subs) in FUSED.items()}
            for _ in range(self.cfg.num_layers)]
        self.adapters: list[LoraAdapter | None] = [None] * max_loras

    def check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.max_loras:
            raise LoraError(f"LoRA slot {slot!r} out of range: slots are 0..{self.max_loras - 1}")

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Put ``adapter`` in ``slot``, replacing what was there (checked first: a refusal changes nothing)."""
        self.check_slot(slot)
        if adapter.rank > self.max_rank:
            raise LoraError(f"LoRA adapter {adapter.path}: rank r={adapter.rank} exceeds max_rank {self.max_rank}")
        for (layer, module), (a, b) in adapter.weights.items():
            if layer >= self.cfg.num_layers or (tuple(b.shape[:1]) + tuple(a.shape[1:])) != module_shape(self.cfg, module):
                raise LoraError(f"LoRA adapter {adapter.path}: layer {layer} {module} does not fit this base model")
        for i, projections in enumerate(self.layers):
            for name, proj in projections.items():
                pieces = {m: adapter.weights[i, m] for m in FUSED[name][1] if (i, m) in adapter.weights}
                proj.write(slot, pieces, adapter.scaling)
        self.adapters[slot] = adapter

    def unload(self, slot: int) -> None:
        self.check_slot(slot)
        for projections in self.layers:
            for proj in projections.values():
                proj.clear(slot)
        self.adapters[slot] = None
