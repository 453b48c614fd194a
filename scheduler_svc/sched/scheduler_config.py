"""The scheduler's knobs, frozen and validated once (the engine core's are in engine/engine_config.py).

Built by the service's ``entrypoints/service_config.py`` from the command line (each flag takes
its default from the field declared here); values learned at run time (the
number of device and CPU blocks, the executor's max length) arrive through the
executor's handshake and are passed to :class:`~scheduler_svc.sched.scheduler.Scheduler`
directly or through ``dataclasses.replace``, never by mutating these objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve import wire
from scheduler_svc.sched.speculation import SpeculativeConfig

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Budgets and policies of one scheduler (one executor's KV pool).

    ``watermark`` is a fraction of the device pool kept free when admitting
    new or swapped-in requests, so that running sequences can still grow a
    block or two without immediately preempting someone (avoids thrashing).
    ``preemption_mode == "swap"`` swaps a victim's blocks to the CPU pool when
    it has room and falls back to recompute otherwise.
    """

    block_size: int = wire.DEFAULT_BLOCK_SIZE
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    preemption_mode: str = "recompute"
    watermark: float = 0.01
    enable_prefix_caching: bool = True
    # Decode steps one plan may carry (BatchPlan.decode_steps): what the executor serves, from its
    # handshake. Taken only when every running sequence decodes plainly and nothing waits.
    decode_steps: int = 1
    # Speculative decoding (--speculative-config; None: off, and for executors that do not score proposals).
    speculative: SpeculativeConfig | None = None
    # LoRA adapters one step may compute (--max-loras, bounded by the executor's slots; 0: none).
    lora_slots: int = 0

    def __post_init__(self) -> None:
        _positive("block_size", self.block_size)
        _positive("max_num_seqs", self.max_num_seqs)
        _positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _positive("max_model_len", self.max_model_len)
        _positive("decode_steps", self.decode_steps)
        if self.decode_steps > wire.MAX_DECODE_STEPS:
            raise ValueError(f"decode_steps must be at most {wire.MAX_DECODE_STEPS}, got {self.decode_steps}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        if type(self.lora_slots) is not int or not 0 <= self.lora_slots <= wire.MAX_LORA_SLOTS:
            raise ValueError(f"lora_slots must be in [0, {wire.MAX_LORA_SLOTS}], got {self.lora_slots!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")

    def watermark_blocks(self, num_device_blocks: int) -> int:
        return int(self.watermark * num_device_blocks)


def _positive(name: str, value: int) -> None:
    if type(value) is not int or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


