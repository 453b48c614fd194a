"""An executor's LoRA rank against the scheduler's, at its handshake (engine/executor_admission.py)."""

from __future__ import annotations

import msgspec

from pagedserve import wire
from scheduler_svc.engine.engine_config import EngineConfig
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing.fake_engine import run
from testing.in_process_engine import handshake_replies


def _hs(name: str, slots: int, rank: int) -> wire.Handshake:
    hs = wire.Handshake(name, wire.WIRE_VERSION, "f" * 64, "tiny", "LlamaForCausalLM", 512, 16, 64, 0, 4096,
                        "float32", "cpu")
    return msgspec.structs.replace(hs, lora_slots=slots, max_lora_rank=rank)


def test_an_executor_with_adapter_slots_must_take_every_rank_the_scheduler_accepts():
    """An executor whose --max-lora-rank is below the scheduler's would fail every request for an
    adapter of a rank between the two, each time one is routed to it: it is refused at its handshake.
    One without slots is accepted (requests naming an adapter are routed around it)."""
    async def replies(enable_lora: bool) -> list[wire.HandshakeReply]:
        cfg = EngineConfig(scheduler=SchedulerConfig(), executor_endpoint="tcp://127.0.0.1:0", heartbeat_interval_s=0.2,
                           enable_lora=enable_lora, max_lora_rank=16)
        return await handshake_replies(cfg, [_hs("low", 2, 8), _hs("none", 0, 0), _hs("equal", 2, 16),
                                             _hs("high", 2, 64)])

    lora = run(replies(True))
    assert [r.accepted for r in lora] == [False, True, True, True]
    assert "its --max-lora-rank 8 is below the scheduler's 16" in lora[0].reason
    assert all(r.accepted for r in run(replies(False)))  # the scheduler serves no adapters: ranks do not matter
