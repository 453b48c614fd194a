"""A tensor-parallel group of N ranks as threads of the test process (tests and benchmarks).

Each rank is a real ``TPGroup`` with its own gloo process groups over loopback, its own model
shard (``load_model(shard=...)``) and KV cache; rank 0 is a ``TensorParallelRunner`` the test
drives like a ModelRunner (``PlanDriver``, the real ``Scheduler``), the followers run
``FollowerRunner.serve()`` in threads. A group failure raises ``GroupFailure`` instead of exiting.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from executor_svc.attention import AttentionBackend
from executor_svc.backends import make_attention_backend
from executor_svc.kv_cache import KVCache
from executor_svc.lora import LoraManager
from executor_svc.lora.served import LoraSlotsOfRunner
from executor_svc.model import load_model, load_model_config
from executor_svc.parallel.group import TPGroup, make_store
from executor_svc.parallel.runner import FollowerRunner, TensorParallelRunner
from executor_svc.sampler import Sampler


def connect_threads(world: int, timeout_s: float = 20.0,
                    on_fatal: Callable[[str], None] | None = None) -> list[TPGroup]:
    """``world`` connected groups (process groups are built concurrently, as ranks would); a
    group failure calls ``on_fatal`` (default: nothing) and raises GroupFailure."""
    master = make_store("127.0.0.1", 0, world, serve=True, timeout_s=timeout_s)
    stores = [master] + [make_store("127.0.0.1", master.port, world, serve=False, timeout_s=timeout_s)
                         for _ in range(1, world)]
    groups = [TPGroup(r, world, stores[r], torch.device("cpu"), loopback=True, on_fatal=on_fatal or (lambda reason: None),
                      collective_timeout_s=timeout_s) for r in range(world)]
    threads = [threading.Thread(target=g.connect) for g in groups]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(g.model_pg is not None and g.ctl_pg is not None for g in groups)
    return groups


def _count_steps(leader: TensorParallelRunner, followers: list[FollowerRunner]) -> Callable[[], None]:
    """Count the plans rank 0 sent and each follower applied; the returned ``settle()`` waits
    until every follower has applied every plan (a step without a forward has no collective, so
    rank 0 may return before the followers applied it: tests that touch a follower's memory wait)."""
    counts = {id(r): 0 for r in [leader, *followers]}
    done = threading.Condition()

    def counted(runner, step):
        def run(plan):
            result = step(plan)
            with done:
                counts[id(runner)] += 1
                done.notify_all()
            return result
        return run

    leader.execute = counted(leader, leader.execute)
    for f in followers:
        f._follow = counted(f, f._follow)

    def settle() -> None:
        with done:
            assert done.wait_for(lambda: all(counts[id(f)] == counts[id(leader)] for f in followers), 30)
    return settle


@contextmanager
def tp_runner(model_dir, world: int = 2, num_blocks: int = 64, num_cpu_blocks: int = 16, block_size: int = 16,
              cpu_attention: str = "fused", backend: Callable[[], AttentionBackend] | None = None,
              lora: tuple[int, int] | None = None, packed: bool = True) -> Iterator[TensorParallelRunner]:
    """Rank 0's runner of a ``world``-rank group; the followers serve in threads until exit.
    ``lora``: (max_loras, max_rank) adapter slots on every rank, as ``--enable-lora`` gives them.
    ``packed=False``: ranks on plain nn.Linear layers and torch attention (the layers' torch path, as
    on CUDA) instead of the CPU-packed ones."""
    groups = connect_threads(world)
    make_backend = backend or (lambda: make_attention_backend("cpu", cpu_attention))
    runners = []
    for g in groups:
        if packed:
            model = load_model(model_dir, shard=g.shard, reduce=g.all_reduce)
        else:
            from testing.lora_adapters import torch_model

            model = torch_model(model_dir, g.shard, g.all_reduce)
            make_backend = backend or (lambda: make_attention_backend("cpu", "torch"))
        kv = KVCache(model.cfg, block_size, num_blocks, num_cpu_blocks, torch.float32)
        if g.is_leader:
            runners.append(TensorParallelRunner(model, kv, make_backend(), g, Sampler(seed=0)))
        else:
            runners.append(FollowerRunner(model, kv, make_backend(), g))
        if lora is not None:
            manager = LoraManager(model, *lora, shard=g.shard, base_cfg=load_model_config(model_dir))
            runners[-1].lora = LoraSlotsOfRunner(manager)
    errors: list[BaseException] = []

    def follow(r: FollowerRunner) -> None:
        try:
            r.serve()
        except BaseException as exc:  # surfaced when the group closes
            errors.append(exc)

    threads = [threading.Thread(target=follow, args=(r,), daemon=True) for r in runners[1:]]
    for t in threads:
        t.start()
    leader = runners[0]
    leader.followers = runners[1:]  # tests look at the followers' state and caches
    leader.settle = _count_steps(leader, runners[1:])
    try:
        yield leader
    finally:
        leader.close()
        for t in threads:
            t.join(30)
    if errors:
        raise errors[0]
