"""Whole executor steps on a GPU, on a model of a real model's shape (``make gpu-check``).

* :func:`decode_steps`: wall and GPU-busy milliseconds per decode step (testing/device_idle.py:
  the wall without the profiler), at 1, 64 and 256 sequences, CUDA graphs off and on, each plan
  prepared while the step before runs (``--prepare-ahead``, the executor's default on CUDA: greedy
  steps chained on the device, executor_svc/token_chain.py);
* :func:`graphs_greedy_equal`: greedy tokens with graphs replayed equal the eager ones;
* :func:`prefill_step`: one prefill step of 16 prompts x 1024 tokens through ``ModelRunner``
  against transformers' forward (SDPA attention) over the same weights, in tokens per second.

The model is ``testing/shaped_models.py``'s ``llama-1.1b-shape``, written at run time (random
bfloat16 weights: 2.2 GB, seconds on the GPU). gpu-check loads it once (:func:`load`) and hands it
to each function; each takes ``device`` so that the CPU tests run the same code on a small shape.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

MODEL = "llama-1.1b-shape"
DECODE_SEQS = (1, 64, 256)


def write_model(root: Path) -> Path:
    from testing.shaped_models import write_shaped_llama

    return write_shaped_llama(root / MODEL, MODEL, torch.bfloat16, device="cuda")


def load(model_dir: Path, device: str = "cuda"):
    from executor_svc.model import load_model

    return load_model(model_dir, device, torch.bfloat16 if device == "cuda" else torch.float32)


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _free(device: str) -> None:
    if device == "cuda":
        torch.cuda.empty_cache()  # what a finished measurement held goes back to the next


def decode_steps(model_dir: Path, model=None, device: str = "cuda", steps: int = 20, prompt: int = 128,
                 seqs_list: tuple[int, ...] = DECODE_SEQS) -> list[dict]:
    """A row per (sequences, graphs off / on); one that raises is an error row."""
    from testing.device_idle import measure

    model = model if model is not None else load(model_dir, device)
    rows = []
    for seqs in seqs_list:
        for graphs in (False, True):
            try:
                m = measure(model_dir, device, seqs=seqs, prompt=prompt, steps=steps, graphs=graphs,
                            prepare_ahead=True, model=model)
                rows.append({"model": MODEL, "seqs": seqs, "graphs": graphs, "prepare_ahead": True,
                             "wall_ms": m["wall_ms_per_step"], "busy_ms": m["busy_ms_per_step"],
                             "build_ms": m["build_ms_per_step"]})
            except Exception as exc:  # noqa: BLE001  report it; the other rows still matter
                rows.append({"model": MODEL, "seqs": seqs, "graphs": graphs, "error": f"{type(exc).__name__}: {exc}"})
            _free(device)
            print(f"  decode step, {seqs} seqs, graphs {graphs}: {rows[-1]}", flush=True)
    return rows


def _runner(model, graphs: bool):
    from executor_svc.backends import make_attention_backend
    from executor_svc.decode_graphs import DecodeGraphs
    from executor_svc.kv_cache import KVCache
    from executor_svc.runner import ModelRunner
    from executor_svc.sampler import Sampler

    device = model.device.type
    kv = KVCache(model.cfg, 16, 2048, 0, model.dtype, device)
    runner = ModelRunner(model, kv, make_attention_backend(device), Sampler(seed=0))
    if graphs:
        runner.graphs = DecodeGraphs(model, kv, runner.backend, runner.max_model_len, (1, 2, 4, 8))
        runner.graphs.capture_all()
    return runner


def graphs_greedy_equal(model_dir: Path, model=None, device: str = "cuda", seqs: int = 8,
                        new_tokens: int = 24) -> bool:
    """8 prompts decoded greedily (the batch walks down the buckets as they finish) with and
    without graphs: the same tokens."""
    from testing.plan_driver import PlanDriver

    model = model if model is not None else load(model_dir, device)
    vocab = model.cfg.vocab_size
    outputs = []
    for graphs in (False, True):
        drv = PlanDriver(_runner(model, graphs))
        for sid in range(seqs):
            drv.add(sid, [(37 * sid + 11 * j) % (vocab - 3) + 3 for j in range(20 + 9 * sid)])
        while todo := {s: 1 << 30 for s in drv.seqs if len(drv.seqs[s].outputs) < new_tokens - s}:
            drv.step(todo)
        outputs.append([drv.seqs[s].outputs for s in range(seqs)])
    return outputs[0] == outputs[1]


def prefill_step(model_dir: Path, model=None, device: str = "cuda", seqs: int = 16, tokens: int = 1024,
                 reps: int = 3) -> dict:
    from transformers import AutoModelForCausalLM

    from testing.plan_driver import PlanDriver

    model = model if model is not None else load(model_dir, device)
    vocab = model.cfg.vocab_size
    prompts = [[(13 * s + 7 * j) % (vocab - 3) + 3 for j in range(tokens)] for s in range(seqs)]
    ours = []
    for rep in range(reps + 1):  # the first compiles the kernels: not counted
        drv = PlanDriver(_runner(model, graphs=False))
        for sid, p in enumerate(prompts):
            drv.add(sid, p)
        _sync(device)
        start = time.perf_counter()
        drv.step({sid: tokens for sid in range(seqs)})
        _sync(device)
        if rep:
            ours.append(time.perf_counter() - start)
    del drv
    _free(device)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=model.dtype, attn_implementation="sdpa").to(device)
    ids = torch.tensor(prompts, device=device)
    theirs = []
    with torch.inference_mode():
        for rep in range(reps + 1):
            _sync(device)
            start = time.perf_counter()
            hf(input_ids=ids, logits_to_keep=1)
            _sync(device)
            if rep:
                theirs.append(time.perf_counter() - start)
    n = seqs * tokens
    return {"tokens": n, "tok_s": round(n / statistics.median(ours)), "hf_tok_s": round(n / statistics.median(theirs))}
