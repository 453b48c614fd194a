"""--batch-invariant at the executor link: only executors that promise it, all computing alike.

Handshakes go over a real DEALER socket to the engine's hub; the reply says whether the executor
may join and why not.
"""

from __future__ import annotations

from pagedserve import wire
from scheduler_svc.engine.engine_config import EngineConfig
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing.fake_engine import run
from testing.in_process_engine import handshake_replies


def _hs(name: str, invariant: bool = True, numerics: str = "cpu float32 avx512", ranks: int = 1,
        dtype: str = "float32") -> wire.Handshake:
    return wire.Handshake(name, wire.WIRE_VERSION, "f" * 64, "tiny", "LlamaForCausalLM", 512, 16, 64, 0, 4096,
                          dtype, "cpu", tensor_parallel_size=ranks, batch_invariant=invariant, numerics=numerics)


async def _replies(batch_invariant: bool, handshakes: list[wire.Handshake]) -> list[wire.HandshakeReply]:
    cfg = EngineConfig(scheduler=SchedulerConfig(), executor_endpoint="tcp://127.0.0.1:0", heartbeat_interval_s=0.2,
                       batch_invariant=batch_invariant)
    return await handshake_replies(cfg, handshakes)


def test_the_mode_admits_only_executors_that_promise_it_and_compute_alike():
    replies = run(_replies(True, [
        _hs("variant", invariant=False, numerics="cpu float32 torch"),
        _hs("first"),
        _hs("avx2", numerics="cpu float32 avx2"),
        _hs("int8", numerics="cpu int8 avx512"),
        _hs("two-ranks", ranks=2),
        _hs("bf16-cache", dtype="bfloat16"),
        _hs("second"),
    ]))
    accepted = [r.accepted for r in replies]
    assert accepted == [False, True, False, False, False, False, True], [r.reason for r in replies]
    assert "runs --batch-invariant and this executor's results depend on their batch" in replies[0].reason
    assert replies[2].reason.endswith("cpu float32 avx2 (KV float32, 1 rank), not cpu float32 avx512 (KV float32, 1 rank)")
    assert "cpu int8 avx512" in replies[3].reason and "2 ranks" in replies[4].reason
    assert "KV bfloat16" in replies[5].reason


def test_without_the_mode_every_executor_is_welcome():
    replies = run(_replies(False, [_hs("variant", invariant=False, numerics="cpu float32 torch"), _hs("avx2"),
                                   _hs("other", numerics="cpu int8 avx2")]))
    assert [r.accepted for r in replies] == [True, True, True], [r.reason for r in replies]
