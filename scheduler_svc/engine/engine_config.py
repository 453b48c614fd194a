"""The engine core's knobs, frozen and validated once (the scheduler's own are in sched/scheduler_config.py).

Built by the service's ``entrypoints/service_config.py`` from the command line; values learned at run
time arrive through the executors' handshakes, never by mutating these objects.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve import wire
from pagedserve.lora_modules import MAX_LORA_RANK, MAX_NAME_CHARS, LoraModule, is_usable_name
from scheduler_svc.engine.executor_auth import LinkSecurity
from scheduler_svc.sched.scheduler_config import SchedulerConfig


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
    batch_invariant: bool = False  # accept only executors whose results cannot depend on their batch, all alike
    # LoRA (--enable-lora): the adapters served (checked at start), the most one step computes on an
    # executor (bounded by its own slots) and the highest rank taken.
    enable_lora: bool = False
    lora_modules: tuple[LoraModule, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    # vLLM's adapters kept in host memory: accepted (and checked) as vllm serve takes it; each
    # executor's own --max-cpu-loras sizes its cache (None: --max-loras)
    max_cpu_loras: int | None = None
    allow_runtime_lora_updating: bool = False  # /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's gate)
    served_model_name: str | None = None  # the model's name in the API (None: the name its executors report)

    def __post_init__(self) -> None:
        if (self.lora_modules or self.allow_runtime_lora_updating) and not self.enable_lora:
            raise ValueError(f"{'--lora-modules' if self.lora_modules else '--allow-runtime-lora-updating'} "
                             "needs --enable-lora")
        if not 1 <= self.max_loras <= wire.MAX_LORA_SLOTS:
            raise ValueError(f"--max-loras must be in [1, {wire.MAX_LORA_SLOTS}], got {self.max_loras}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"--max-cpu-loras ({self.max_cpu_loras}) must be >= --max-loras ({self.max_loras})")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(f"--max-lora-rank must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}")
        names = [m.name for m in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules: a name given twice in {names}")
        name = self.served_model_name
        if name is not None and not is_usable_name(name):
            raise ValueError(f"--served-model-name: 1 to {MAX_NAME_CHARS} printable characters, no leading or "
                             f"trailing space (got {name[:MAX_NAME_CHARS]!r})")
        if not isinstance(self.stream_interval, int) or self.stream_interval < 1:
            raise ValueError(f"EngineConfig.stream_interval must be an integer >= 1 (got {self.stream_interval!r})")
