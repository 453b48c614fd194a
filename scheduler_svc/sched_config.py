"""Scheduler and engine knobs, frozen and validated once.

Built by the service's ``config.py`` from the command line (each flag takes
its default from the field declared here); values learned at run time (the
number of device and CPU blocks, the executor's max length) arrive through the
executor's handshake and are passed to :class:`~scheduler_svc.scheduler.Scheduler`
directly or through ``dataclasses.replace``, never by mutating these objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve import wire
from scheduler_svc.executor_auth import LinkSecurity

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
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")

    def watermark_blocks(self, num_device_blocks: int) -> int:
        return int(self.watermark * num_device_blocks)


def _positive(name: str, value: int) -> None:
    if type(value) is not int or value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """The engine's own knobs; ``scheduler`` is the template each executor's Scheduler gets."""

    scheduler: SchedulerConfig
    executor_endpoint: str  # ZeroMQ ROUTER endpoint executors dial in to, e.g. tcp://0.0.0.0:5556
    heartbeat_interval_s: float = wire.DEFAULT_HEARTBEAT_INTERVAL_S
    max_queued_requests: int = 1024
    max_migrations: int = 3
    async_scheduling: bool = True  # plan step k+1 while the executor runs step k
    stream_interval: int = 1  # after a request's first output, tokens a choice gathers before its consumer wakes
    executor_link: LinkSecurity | None = None  # CURVE keys of the executor link and who is admitted (None: none)
    step_timeout_s: float = 30.0  # least time a step may take before its executor counts as failed
    max_failed_steps: int = 3  # consecutive steps an executor fails as a whole before it is dropped
    orphan_timeout_s: float = 60.0  # how long a request whose executors all died waits for another
    model_fingerprint: str | None = None  # the served model (from --model's weights), None: the first executor's

    def __post_init__(self) -> None:
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"EngineConfig.stream_interval must be an integer >= 1 (got {self.stream_interval!r})")
