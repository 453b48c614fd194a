"""``python -m executor_svc`` / ``pagedserve-executor``: one executor process.

Start-up order: health server (liveness while weights load), config.json
check, weights, KV pools sized from the memory budget, then dial the scheduler.
SIGTERM drains (see worker.py); a second SIGTERM or SIGINT exits at once.

With ``--tensor-parallel-size N`` the process first joins (or, as rank 0, starts) a
group of N ranks (executor_svc/parallel/): each loads its shard, the KV pools get
the group's minimum block count, rank 0 alone dials the scheduler and the others
follow its plans until it stops them.
"""

from __future__ import annotations

import faulthandler
import logging
import signal
import sys
import time

import torch

from executor_svc import threads
from executor_svc.attention_cpu import FusedCpuAttentionBackend
from executor_svc.backends import make_attention_backend
from executor_svc.batch_invariance import batch_variance, numerics
from executor_svc.config import ExecutorConfig, parse_config, require_device
from executor_svc.decode_graphs import DecodeGraphs
from executor_svc.grammar import GrammarBackend
from executor_svc.kv_cache import KVCache, bytes_per_block
from executor_svc.lora.manager import LoraManager
from executor_svc.lora.served import LoraSlotsOfRunner
from executor_svc.malloc_tuning import retain_freed_memory
from executor_svc.model import load_model, load_model_config, model_fingerprint
from executor_svc.model.architecture import ModelConfig
from executor_svc.parallel.group import TPGroup
from executor_svc.parallel.runner import FollowerRunner, TensorParallelRunner
from executor_svc.parallel.serve import close_group, serve_follower, start_group
from executor_svc.parallel.shard import NO_SHARD
from executor_svc.runner import ModelRunner
from executor_svc.sampler import Sampler
from executor_svc.speculative.draft import DraftModel
from executor_svc.warmup import warm_up
from executor_svc.worker import ComputeThread, ExecutorWorker
from pagedserve import wire
from pagedserve.draft_model import draft_name
from pagedserve.fd_limits import raise_open_files_limit
from pagedserve.gc_tuning import tune_gc
from pagedserve.model_dir import is_gguf

log = logging.getLogger("executor_svc")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def resolve_dtype(cfg: ExecutorConfig, model_cfg: ModelConfig) -> torch.dtype:
    """auto: float32 on CPU (bf16/fp16 matmuls are far slower there), the checkpoint's on CUDA."""
    if cfg.dtype != "auto":
        return _DTYPES[cfg.dtype]
    if cfg.device == "cpu":
        return torch.float32
    return _DTYPES.get(model_cfg.torch_dtype, torch.float32)


def device_kv_bytes(cfg: ExecutorConfig, model, backend, graphs: bool) -> int:
    """KV budget: the flag on CPU; on CUDA what is left of the utilisation share after the
    weights, the activation peak of a profiled worst-case step (executor_svc/gpu_memory.py) and,
    with ``graphs`` (captured after the pool is sized), the decode graphs' logits buffer."""
    if cfg.device == "cpu":
        return cfg.kv_cache_memory
    from executor_svc.gpu_memory import make_profile_step, profile_kv_budget

    step = make_profile_step(model, backend, wire.DEFAULT_MAX_NUM_BATCHED_TOKENS, cfg.block_size)
    prof = profile_kv_budget(step, cfg.gpu_memory_utilization, model.device)
    graph_logits = max(cfg.cuda_graph_sizes) * model.cfg.vocab_size * 4 if graphs else 0
    kv_bytes = max(0, prof.kv_budget_bytes - graph_logits)
    log.info("GPU memory: total %.1f GiB, weights %.2f GiB, step peak %.2f GiB, other %.2f GiB, decode graphs' "
             "logits %.2f GiB -> KV %.2f GiB", *(x / 2**30 for x in (prof.total_bytes, prof.weights_bytes, prof.peak_bytes,
                                                                      prof.non_torch_bytes, graph_logits, kv_bytes)))
    return kv_bytes


def load_draft(cfg: ExecutorConfig, model, dtype: torch.dtype):
    """The draft model (--speculative-model), in the model's dtype; ValueError naming it when it
    cannot serve beside the model (a vocabulary of another size, a shorter context)."""
    draft_cfg = load_model_config(cfg.speculative_model)
    if draft_cfg.vocab_size != model.cfg.vocab_size:
        raise ValueError(f"--speculative-model {cfg.speculative_model}: a vocabulary of {draft_cfg.vocab_size}, the "
                         f"model has {model.cfg.vocab_size}")
    quantization = "gguf" if cfg.device == "cpu" and is_gguf(cfg.speculative_model) and cfg.dtype == "auto" else None
    return load_model(cfg.speculative_model, cfg.device, dtype, quantization=quantization,
                      cpu_kernels=cfg.cpu_attention != "torch", fused_layers=cfg.fused_layers)


def draft_pools(target, draft, block_size: int, device_bytes: int, cpu_bytes: int, dtype: torch.dtype,
                device) -> tuple[KVCache, KVCache]:
    """The model's and the draft's pools, the same number of blocks each, sized from both models'
    bytes per block (so the handshake's block counts already account for the draft's memory)."""
    per = bytes_per_block(target, block_size, dtype) + bytes_per_block(draft, block_size, dtype)
    num, num_cpu = device_bytes // per, cpu_bytes // per
    if num <= 0:
        raise ValueError(f"kv cache memory: {device_bytes} bytes is less than one block of the model and its draft "
                         f"model ({per} bytes); raise the budget or use a smaller --speculative-model")
    return (KVCache(target, block_size, num, num_cpu, dtype, device),
            KVCache(draft, block_size, num, num_cpu, dtype, device))


def build_runner(cfg: ExecutorConfig, group: TPGroup | None = None) -> tuple[ModelRunner, wire.Handshake]:
    """The runner and handshake of one executor, or of this rank of a tensor-parallel group."""
    model_cfg = load_model_config(cfg.model_dir)  # refuse unsupported models before reading weights
    shard = group.shard if group is not None else NO_SHARD
    dtype = resolve_dtype(cfg, model_cfg)
    if cfg.device == "cpu" and (dtype == torch.float16 or (group is not None and dtype != torch.float32)):
        log.warning("computing in %s on CPU: expect it to be much slower than float32", dtype)
    device = group.device if group is not None else cfg.device
    model = load_model(cfg.model_dir, device, dtype, shard, group.all_reduce if group is not None else None,
                       quantization=cfg.quantization, cpu_kernels=cfg.cpu_attention != "torch",
                       fused_layers=cfg.fused_layers)
    if model.decode_stack is not None:
        model.decode_stack.threads.enabled = cfg.cpu_decode_threads == "adaptive"
    backend = make_attention_backend(cfg.device, cfg.cpu_attention)
    if isinstance(backend, FusedCpuAttentionBackend) and model.dtype != torch.float32:  # (activations: float32 when packed)
        log.warning("the fused CPU decode kernel computes in float32: %s attention uses the torch path", dtype)
    variance = batch_variance(model, backend)
    if variance is None and cfg.max_loras:
        variance = "LoRA deltas are torch matrix products over each adapter's tokens, rounded by their count"
    model_numerics = numerics(model, cfg.device)  # (before LoRA wraps the projections it reads)
    if variance is not None:
        if cfg.batch_invariant:
            raise ValueError(f"--batch-invariant: this executor's results would depend on their batch: {variance}")
        log.info("results are not batch-invariant: %s", variance)
    agree = None
    if group is not None:
        group.exchange("loaded", "1")  # every shard in place before the profiling step's collectives
        agree = lambda counts: group.min_over_ranks("kv_blocks", counts)  # noqa: E731
    draft = load_draft(cfg, model, dtype) if cfg.speculative_model is not None else None
    device_bytes = device_kv_bytes(cfg, model, backend, graphs=captures_graphs(cfg, group))
    if draft is None:
        kv = KVCache.from_budget(model.cfg, cfg.block_size, device_bytes, cfg.swap_space, dtype, device, agree=agree)
    else:  # one block table, two pools: a block costs both models' bytes
        kv, draft_kv = draft_pools(model.cfg, draft.cfg, cfg.block_size, device_bytes, cfg.swap_space, dtype, device)
    max_len = min(model_cfg.max_position_embeddings, kv.num_blocks * cfg.block_size)
    if draft is not None:  # (the draft drafts at every position the model serves)
        max_len = min(max_len, draft.cfg.max_position_embeddings)
    if group is None:
        runner = ModelRunner(model, kv, backend, Sampler(), max_model_len=max_len)
        runner.max_decode_steps = cfg.decode_steps
        if cfg.prepare_ahead is not None:
            runner.prepare_ahead = cfg.prepare_ahead
    elif group.is_leader:
        runner = TensorParallelRunner(model, kv, backend, group, Sampler(), max_model_len=max_len)
    else:
        runner = FollowerRunner(model, kv, backend, group, max_model_len=max_len)
    if not isinstance(runner, FollowerRunner):  # the rank that samples constrains (structured outputs)
        runner.grammar = GrammarBackend.for_model(cfg.model_dir, model_cfg.vocab_size)
    if draft is not None:
        runner.draft = DraftModel(draft, draft_kv, make_attention_backend(cfg.device, cfg.cpu_attention), runner.sampler,
                                  draft_name(cfg.speculative_model))
        log.info("speculative decoding: draft model %s, %d layers, its KV pools beside the model's",
                 runner.draft.name, draft.cfg.num_layers)
    if cfg.max_loras:
        runner.lora = LoraSlotsOfRunner(LoraManager(model, cfg.max_loras, cfg.max_lora_rank, getattr(torch, cfg.lora_dtype),
                                                    cfg.max_cpu_loras, shard=shard, base_cfg=model_cfg))
        log.info("LoRA: %d adapter slots of rank up to %d in %s, %d adapters kept in host memory", cfg.max_loras,
                 cfg.max_lora_rank, cfg.lora_dtype, cfg.max_cpu_loras)  # (each TP rank: its slice of every adapter)
    log.info("%s: %d layers, %d KV blocks of %d tokens (%d CPU swap blocks), max length %d, %s, "
             "attention backend %s%s", model_cfg.architecture, model_cfg.num_layers, kv.num_blocks,
             cfg.block_size, kv.num_cpu_blocks, max_len, str(dtype).removeprefix("torch."), backend.name,
             f", rank {shard.rank} of {shard.size}: {model.cfg.num_heads} q / {model.cfg.num_kv_heads} KV heads, "
             f"{model.cfg.intermediate_size} MLP columns" if group is not None else "")
    if getattr(runner, "prepare_ahead", False):
        log.info("each queued plan is prepared while the step before it runs (--prepare-ahead)")
    hs = wire.Handshake(
        executor_id=cfg.executor_id, wire_version=wire.WIRE_VERSION,
        model_fingerprint=model_fingerprint(cfg.model_dir), model_name=cfg.model_dir.resolve().name,
        architecture=model_cfg.architecture, vocab_size=model_cfg.vocab_size, block_size=cfg.block_size,
        num_device_blocks=kv.num_blocks, num_cpu_blocks=kv.num_cpu_blocks, max_model_len=max_len,
        dtype=str(dtype).removeprefix("torch."), device=cfg.device, tensor_parallel_size=cfg.tensor_parallel_size,
        max_decode_steps=runner.decode_steps_served(), speculative=True,
        batch_invariant=variance is None, numerics=model_numerics,
        lora_slots=cfg.max_loras, max_lora_rank=cfg.max_lora_rank if cfg.max_loras else 0,
        draft_model=runner.draft.name if getattr(runner, "draft", None) is not None else "",
        draft_vocab_size=draft.cfg.vocab_size if draft is not None else 0)
    return runner, hs


def captures_graphs(cfg: ExecutorConfig, group: TPGroup | None) -> bool:
    """Whether this executor replays its decode steps from CUDA graphs (one device, not --enforce-eager)."""
    return cfg.device == "cuda" and group is None and not cfg.enforce_eager


def capture_decode_graphs(runner: ModelRunner, sizes: tuple[int, ...]) -> None:
    """Capture every decode bucket into a CUDA graph (executor_svc/decode_graphs.py)."""
    start = time.perf_counter()
    held = torch.cuda.memory_reserved()
    runner.graphs = DecodeGraphs(runner.model, runner.kv, runner.backend, runner.max_model_len, sizes)
    runner.graphs.capture_all()
    log.info("decode steps of up to %d sequences replay CUDA graphs (%d sizes captured in %.1f s, holding "
             "%.0f MiB; --enforce-eager turns them off)", sizes[-1], len(sizes), time.perf_counter() - start,
             (torch.cuda.memory_reserved() - held) / 2**20)


def run(cfg: ExecutorConfig, argv: list[str] | None = None) -> int:
    """``argv``: this process's flags, which a tensor-parallel leader passes on to its ranks."""
    health = None
    if cfg.health_port:
        from executor_svc.health import HealthServer

        health = HealthServer(cfg.health_port, cfg.health_host).start()
    group, runner = None, None
    try:
        if cfg.device == "cpu":
            threads.configure(cfg.cpu_threads)
            retain_freed_memory()  # before the weights: every step's activations reuse the same pages
        if cfg.tensor_parallel_size > 1:
            group = start_group(cfg, sys.argv[1:] if argv is None else argv)
        if group is not None and not group.is_leader:  # a follower runs torch on this thread alone
            runner, _ = build_runner(cfg, group)
            tune_gc()
            return serve_follower(runner, health)
        compute = ComputeThread()  # every torch call from here on, loading included (worker.py says why)
        runner, hs = compute.call(build_runner, cfg, group)
        if cfg.warmup and cfg.device == "cpu" and group is None:
            compute.call(warm_up, runner)  # before dialling in: the first request must not pay for it
        if captures_graphs(cfg, group):
            compute.call(capture_decode_graphs, runner, cfg.cuda_graph_sizes)  # before any sequence exists
        tune_gc()  # what start-up allocated (torch, the model) is never walked again by the collector
        worker = ExecutorWorker(cfg.scheduler, runner, hs, drain_timeout=cfg.drain_timeout, health=health,
                                keys=cfg.link_keys, enrollment_token_file=cfg.enrollment_token_file,
                                compute=compute)
        if group is not None:
            group.watchdog.on_drain = worker.request_drain
        signal.signal(signal.SIGTERM, lambda *_: worker.request_drain())
        signal.signal(signal.SIGINT, lambda *_: (worker.request_drain(), worker.request_drain()))
        return worker.run()
    finally:
        if group is not None:
            close_group(group, runner)
        if health is not None:
            health.stop()


def main(argv: list[str] | None = None) -> None:
    faulthandler.enable()  # a fatal signal (SIGSEGV, SIGABRT) prints every thread's traceback
    cfg = parse_config(argv)
    require_device(cfg)
    rank = f" rank{cfg.rank_env.rank}" if cfg.rank_env is not None else " rank0" if cfg.tensor_parallel_size > 1 else ""
    logging.basicConfig(level=cfg.log_level, format=f"%(asctime)s %(levelname)s{rank} %(name)s: %(message)s")
    raise_open_files_limit()
    try:
        code = run(cfg, argv)
    except (ValueError, FileNotFoundError) as exc:  # bad model dir, unsupported model, budget too small
        log.error("cannot start: %s", exc)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
