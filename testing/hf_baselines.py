"""The Hugging Face transformers baselines of benchmarks/serve_vs_hf.py, run in this process, and
that benchmark's report of pagedserve against them (:func:`report`, :func:`format_table`).

* :func:`run_static`: ``model.generate`` on static batches of ``batch_size``
  requests in arrival order, left-padded to the batch's longest prompt; every
  sequence of a batch runs until the batch's longest output is done (EOS is
  suppressed with ``min_new_tokens``, like ``ignore_eos``), so only the
  requested tokens count as useful output.
* :func:`run_continuous`: transformers' own continuous batching (the paged
  ``ContinuousBatchingManager`` behind ``generate_batch``), each request with
  its own ``max_new_tokens`` and EOS disabled (``eos_token_id=-1``). On CPU
  its cache cannot size itself (it reads free GPU memory, or psutil when
  installed), so we pass ``num_blocks`` (pages of ``page_size`` tokens) and
  ``max_batch_tokens`` explicitly, and turn CUDA graphs and prefix sharing off.

Both time only generation: model loading and the manager's start are outside.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedserve.bench.workloads import TraceRequest

CB_PAGE_SIZE = 256  # transformers' default page size (tokens per page)


@dataclass(slots=True)
class RunResult:
    """One system's pass over a trace."""

    name: str
    wall_s: float
    useful_tokens: int  # output tokens the requests asked for
    generated_tokens: int  # tokens computed, padding waste included
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds (user + system) per process

    @property
    def tokens_per_s(self) -> float:
        return self.useful_tokens / self.wall_s


def load_model(path: Path) -> torch.nn.Module:
    """The checkpoint as a float32 transformers model in eval mode, on CPU."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _left_padded(prompts: list[tuple[int, ...]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask), each ``[batch, longest prompt]`` int64, padding on the left."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[i, width - len(p):] = 1
    return ids, mask


@torch.inference_mode()
def run_static(model: torch.nn.Module, trace: list[TraceRequest], batch_size: int, pad_id: int) -> RunResult:
    """Static batching with ``generate``; raises RuntimeError if a batch comes back short."""
    from transformers import GenerationConfig

    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    generated = 0
    start = time.perf_counter()
    for s in range(0, len(trace), batch_size):
        batch = trace[s:s + batch_size]
        steps = max(r.output_len for r in batch)
        ids, mask = _left_padded([r.prompt_token_ids for r in batch], pad_id)
        cfg = GenerationConfig(max_new_tokens=steps, min_new_tokens=steps, do_sample=False,
                               pad_token_id=pad_id, eos_token_id=model.config.eos_token_id)
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=cfg)
        if out.shape != (len(batch), ids.shape[1] + steps):
            raise RuntimeError(f"generate returned {tuple(out.shape)}, expected "
                               f"{(len(batch), ids.shape[1] + steps)}")
        generated += len(batch) * steps
    wall = time.perf_counter() - start
    return RunResult(f"hf-static-b{batch_size}", wall, sum(r.output_len for r in trace), generated)


def cb_num_blocks(trace: list[TraceRequest]) -> int:
    """Pages enough for every request of ``trace`` at once (no eviction), one spare page each."""
    return sum(math.ceil((r.prompt_len + r.output_len) / CB_PAGE_SIZE) + 1 for r in trace)


@torch.inference_mode()
def run_continuous(model: torch.nn.Module, trace: list[TraceRequest], max_batch_tokens: int,
                   timeout_s: float = 3600.0) -> RunResult:
    """transformers' continuous batching over ``trace`` (all requests queued at once)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, eos_token_id=-1, max_new_tokens=max(r.output_len for r in trace))
    cb = ContinuousBatchingConfig(page_size=CB_PAGE_SIZE, num_blocks=cb_num_blocks(trace),
                                  max_batch_tokens=max_batch_tokens, allow_block_sharing=False,
                                  use_cuda_graph=False, max_requests_per_batch=len(trace))
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   block=True, timeout=30, warmup=False) as manager:
        start = time.perf_counter()
        for r in trace:
            manager.add_request(list(r.prompt_token_ids), request_id=r.request_id, max_new_tokens=r.output_len)
        done = _collect(manager, {r.request_id: r.output_len for r in trace}, start + timeout_s)
        wall = time.perf_counter() - start
    return RunResult(f"hf-continuous-mbt{max_batch_tokens}", wall, sum(done.values()), sum(done.values()))


def _collect(manager, want: dict[str, int], deadline: float) -> dict[str, int]:
    """request_id -> tokens generated, once every request finished with its full length."""
    done: dict[str, int] = {}
    while len(done) < len(want):
        if time.perf_counter() > deadline:
            raise RuntimeError(f"transformers continuous batching: {len(want) - len(done)} requests "
                               f"unfinished at the deadline")
        result = manager.get_result(timeout=1)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("transformers continuous batching: its generation thread stopped")
            continue
        if result.is_finished():
            if result.error is not None or len(result.generated_tokens) != want[result.request_id]:
                raise RuntimeError(f"transformers continuous batching: request {result.request_id} ended "
                                   f"with {len(result.generated_tokens)} tokens of "
                                   f"{want[result.request_id]} (error {result.error!r})")
            done[result.request_id] = len(result.generated_tokens)
    return done


TARGET_VS_STATIC, TARGET_VS_CB = 3.0, 1.5


def report(args: argparse.Namespace, trace: list[TraceRequest], runs: dict) -> dict:
    """The JSON line of benchmarks/serve_vs_hf.py from each system's tok/s per repetition."""
    med = statistics.median
    ps = med(runs["pagedserve"])
    static = {b: med(v) for b, v in runs["hf_static"].items()}
    # the batch size measured in every repetition (the best of repetition 1)
    best = max(static, key=lambda b: (len(runs["hf_static"][b]), static[b])) if static else None
    cb = med(runs["hf_cb"]) if runs["hf_cb"] else None
    out = {
        "benchmark": "serve_vs_hf", "model": str(args.model), "num_requests": len(trace),
        "input_len": args.input_len, "output_len": args.output_len, "reps": args.reps,
        "threads": args.threads, "output_tokens": sum(r.output_len for r in trace),
        "pagedserve_tok_s": ps,
        "hf_static_tok_s": static.get(best) if best else None, "hf_static_best_batch": best,
        "hf_static_by_batch_tok_s": static, "hf_cb_tok_s": cb,
        "speedup_vs_static": ps / static[best] if best else None,
        "speedup_vs_cb": ps / cb if cb else None,
        "runs_tok_s": {k: v for k, v in runs.items() if k != "cpu_s"},
        "cpu_s": runs.get("cpu_s", []),  # per run: wall and CPU seconds of each process involved
    }
    out["meets_targets"] = bool((out["speedup_vs_static"] or 0) >= TARGET_VS_STATIC
                                and (out["speedup_vs_cb"] or 0) >= TARGET_VS_CB)
    return out


def format_table(r: dict) -> str:
    rows = [("pagedserve (scheduler + executor, gRPC)", r["pagedserve_tok_s"], None, None)]
    for b, v in sorted(r["hf_static_by_batch_tok_s"].items()):
        mark = " (best)" if b == r["hf_static_best_batch"] else ""
        rows.append((f"transformers generate, static batch {b}{mark}", v, TARGET_VS_STATIC, b))
    if r["hf_cb_tok_s"]:
        rows.append(("transformers continuous batching", r["hf_cb_tok_s"], TARGET_VS_CB, None))
    lines = [f"{r['num_requests']} requests, prompts {r['input_len']}, outputs {r['output_len']} tokens, "
             f"{r['output_tokens']} output tokens; torch threads {r['threads']}; median of {r['reps']}",
             f"{'system':<50}{'tok/s':>10}{'pagedserve x':>14}{'target':>8}"]
    for name, v, target, _ in rows:
        ratio = r["pagedserve_tok_s"] / v
        lines.append(f"{name:<50}{v:>10.1f}{ratio:>14.2f}{(f'>={target:g}' if target else ''):>8}")
    return "\n".join(lines)
