"""How long the device waits per step inside the executor (plan ready, nothing else to wait for).

With asynchronous scheduling the next plan is always queued when a step ends, so
what is left of the device's idle time is the executor's own host work in a
step: applying the plan, building the batch's tensors, and the sampler's sync.
The real scheduler plans the steps (in this process, outside the timed window);
each ``ModelRunner.execute`` is timed, and on CUDA the union of the kernels'
intervals from torch.profiler is the device's busy time. On CPU "busy" is the
time inside the model's forward and LM head (there is no separate device).
The wall time comes from steps run without the profiler (it adds milliseconds of
host work per step); the busy time from as many steps run under it right after.
``graphs``: decode steps replay CUDA graphs (executor_svc/decode_graphs.py; on
CPU their eager twin). ``build_ms_per_step``: the part of the host work that lays out the batch
(``ModelRunner._build``: ``build_batch`` and a speculating batch's rows), from the wall run.

``benchmarks/device_idle.py`` is its command line; ``make gpu-check`` runs it on the GPU
(benchmarks/kernels/gpu_check.py); the tests check it on the CPU.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch

from executor_svc.backends import make_attention_backend
from executor_svc.decode_graphs import DecodeGraphs
from executor_svc.graph_buckets import DEFAULT_SIZES, bucket_for
from executor_svc.kv_cache import KVCache
from executor_svc.model import load_model
from executor_svc.model.llama import LlamaForCausalLM
from executor_svc.pipeline import StepPipeline
from executor_svc.runner import ModelRunner
from executor_svc.sampler import Sampler
from pagedserve.engine_api import GenerationRequest, RequestParams
from pagedserve.wire import SamplingParams
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig


def _busy_union_us(events) -> float:
    """Length of the union of the kernels' [start, end) intervals, in microseconds."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    total, cur_start, cur_end = 0.0, None, None
    for s, e in spans:
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                total += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    return total + (cur_end - cur_start if cur_end is not None else 0.0)


def measure(model_dir: Path, device: str = "cpu", seqs: int = 64, prompt: int = 128, steps: int = 30,
            warmup: int = 4, prepare_ahead: bool = False, graphs: bool = False,
            dtype: torch.dtype | None = None, model: LlamaForCausalLM | None = None) -> dict:
    """``prepare_ahead``: the timed steps go through a StepPipeline with two plans in flight, as the
    executor runs them on a GPU (executor_svc/pipeline.py); else one plan at a time. ``model``: the
    model of ``model_dir``, already loaded on ``device`` (a caller measuring several rows loads it
    once); it is left as it was."""
    dtype = dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    model = model if model is not None else load_model(model_dir, device, dtype)
    bs, blocks = 16, seqs * (-(-(prompt + warmup + 2 * steps + 2) // 16)) + 8
    kv = KVCache(model.cfg, bs, blocks, 0, dtype, device)
    runner = ModelRunner(model, kv, make_attention_backend(device), Sampler(seed=0))
    if graphs:  # every decode step of this workload has all ``seqs`` sequences: one bucket
        runner.graphs = DecodeGraphs(model, kv, runner.backend, runner.max_model_len,
                                     (bucket_for(seqs, DEFAULT_SIZES) or seqs,))
        runner.graphs.capture_all()
    sched = Scheduler(SchedulerConfig(block_size=bs, max_num_seqs=seqs, max_num_batched_tokens=seqs * prompt,
                                      max_model_len=4096), blocks, 0, ())
    vocab = model.cfg.vocab_size
    for i in range(seqs):
        sched.add_request(GenerationRequest(f"r{i}", [(i * 7 + j) % (vocab - 4) + 2 for j in range(prompt)],
                                            RequestParams(max_tokens=warmup + 2 * steps + 1, ignore_eos=True,
                                                          sampling=SamplingParams(temperature=0.0))))

    def step() -> float:
        plan = sched.schedule()
        start = time.perf_counter()
        result = runner.execute(plan)
        if device == "cuda":
            torch.cuda.synchronize()
        took = time.perf_counter() - start
        sched.update(result)
        return took

    def pipelined(n: int) -> float:
        """The executor's time for ``n`` plans, two in flight; the scheduler's calls are not
        counted (step() times the runner alone too)."""
        pipe, pushed, sched_s, start = StepPipeline(runner), 0, 0.0, time.perf_counter()
        while True:
            t = time.perf_counter()
            plan = sched.schedule() if pushed < n and len(sched.in_flight) < 2 else None
            sched_s += time.perf_counter() - t
            if plan is not None:
                pushed += 1
                results = pipe.push(plan)
            elif pipe.in_flight is not None:
                results = [pipe.finish()]
            else:
                break
            t = time.perf_counter()
            for result in results:
                sched.update(result)
            sched_s += time.perf_counter() - t
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - start - sched_s

    for _ in range(warmup):  # prefill and the first decodes (kernel compiles, caches)
        step()
    forward_s = 0.0

    def timed(fn):
        def run(*a, **k):
            nonlocal forward_s
            t = time.perf_counter()
            out = fn(*a, **k)
            if device == "cuda":
                torch.cuda.synchronize()
            forward_s += time.perf_counter() - t
            return out
        return run

    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)

    def run_steps() -> float:
        return pipelined(steps) if prepare_ahead else sum(step() for _ in range(steps))

    build_s = 0.0
    build = runner._build

    def timed_build(*a, **k):  # host work alone, so no device sync
        nonlocal build_s
        t = time.perf_counter()
        out = build(*a, **k)
        build_s += time.perf_counter() - t
        return out

    runner._build = timed_build
    if device == "cuda":
        wall = run_steps()  # without the profiler, which adds host work to every step
        runner._build = build
        with torch.profiler.profile(activities=activities) as prof:
            run_steps()
    else:  # the model's compute, its layers and the LM head, timed around its calls (on the instance)
        model.forward_with_logits, model.compute_logits = timed(model.forward_with_logits), timed(model.compute_logits)
        try:
            wall = run_steps()
        finally:
            del model.forward_with_logits, model.compute_logits  # the class's methods again
    if device == "cuda":
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        busy = _busy_union_us(kernels) / 1e6
    else:
        busy = forward_s
    return {"device": device, "seqs": seqs, "prompt": prompt, "steps": steps, "prepare_ahead": prepare_ahead,
            "graphs": graphs, "replays": runner.graphs.replays if runner.graphs is not None else 0,
            "wall_ms_per_step": round(1e3 * wall / steps, 3), "busy_ms_per_step": round(1e3 * busy / steps, 3),
            "idle_ms_per_step": round(1e3 * (wall - busy) / steps, 3), "idle_frac": round(1 - busy / wall, 4),
            "build_ms_per_step": round(1e3 * build_s / steps, 3)}
