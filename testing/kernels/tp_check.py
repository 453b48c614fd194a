"""A tensor-parallel group on real devices against transformers: ``make gpu-check``'s N = 2 case.

    python -m testing.kernels.tp_check [--device cuda|cpu] [--world 2] [--model DIR]

Starts an N-rank group exactly as ``pagedserve-executor --tensor-parallel-size N`` does (this
process is rank 0; with ``--device cuda`` rank r uses GPU r and the model's all-reduces go
through NCCL, the plans through gloo), loads the tiny 8-q / 4-KV-head Llama, and generates
greedily for prompts of several lengths, prefilled in chunks of 7 tokens while the others
decode (the CuPy prefill and decode kernels with the per-rank head counts on CUDA). Exit status 0
when every sequence equals transformers' greedy output token for token. ``--device cpu`` runs
the same path with gloo (tests/process/test_tp_check.py does, on machines without GPUs).
:func:`run_tp_check` is how ``make gpu-check`` runs it: in its own process, or skipped with the
reason when the machine has fewer GPUs than ranks.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from testing.plan_driver import PlanDriver

PROMPT_LENS = (5, 19, 40)
MAX_NEW = 12
CHUNK = 7


def skip_reason(device: str, world: int, device_count: int) -> str | None:
    """None when the check can run here, else the message saying why it is skipped."""
    if device == "cuda" and device_count < world:
        return (f"tensor-parallel check (N = {world}, NCCL) skipped: it needs {world} GPUs, "
                f"this machine has {device_count}")
    return None


def run_tp_check(timeout_s: int, device_count: int) -> dict:
    """The N = 2 NCCL case when there are two GPUs; otherwise {"skipped": why}."""
    reason = skip_reason("cuda", 2, device_count)
    if reason is not None:
        return {"skipped": reason, "returncode": 0}
    return run_command([sys.executable, "-m", "testing.kernels.tp_check", "--device", "cuda", "--world", "2"], timeout_s)


def run_command(cmd: list[str], timeout_s: int) -> dict:
    """Run ``cmd``: its exit status (124 when it timed out), seconds and the last 40 lines it printed
    (stdout and stderr as they came). On a timeout its whole process group is killed, so no grandchild (an
    executor a test started) keeps holding the GPU for what runs next."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        rc, head = proc.returncode, ""
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        rc, head = 124, f"timed out after {timeout_s}s\n"
    output = head + out.decode(errors="replace")
    tail = "\n".join(output.strip().splitlines()[-40:])
    return {"returncode": rc, "seconds": round(time.perf_counter() - start, 1), "tail": tail}


def greedy(runner, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    """Prefill in chunks of CHUNK tokens while the others decode, to ``max_new`` outputs each."""
    driver = PlanDriver(runner)
    for i, p in enumerate(prompts):
        driver.add(i, p)
    driver.run_until(max_new, chunk=CHUNK)
    return [driver.seqs[i].outputs for i in range(len(prompts))]


def hf_greedy(model_dir: Path, prompt: list[int], max_new: int) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


def check(model_dir: Path, device: str, world: int) -> bool:
    from testing.tensor_parallel import serving_runner

    prompts = [[(11 * i + 5 * j) % 480 + 3 for j in range(n)] for i, n in enumerate(PROMPT_LENS)]
    # transformers' outputs first, before the group starts: rank 0's runner builds its grammar
    # compiler on a thread of its own, which imports xgrammar and with it transformers, slowly on a
    # busy machine. transformers puts a lazy module in its own place in sys.modules while it is
    # imported; a thread importing it meanwhile is handed the module it replaced, which has none
    # of its names (ImportError: cannot import name 'AutoModelForCausalLM'). On one torch thread,
    # as they always were (serving_runner's count per rank).
    torch.set_num_threads(1)
    refs = [hf_greedy(model_dir, p, MAX_NEW) for p in prompts]
    with serving_runner(model_dir, world, threads=world, device=device) as runner:
        ours = greedy(runner, prompts, MAX_NEW)
        heads = (runner.model.cfg.num_heads, runner.model.cfg.num_kv_heads)
    ok = True
    for p, got, ref in zip(prompts, ours, refs, strict=True):
        ok &= got == ref
        print(f"  prompt of {len(p):2d} tokens: {'PASS' if got == ref else 'FAIL'} ours {got} transformers {ref}")
    print(f"tensor-parallel N = {world} on {device} (rank 0: {heads[0]} q / {heads[1]} KV heads): "
          f"{'PASS' if ok else 'FAIL'}")
    return ok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m testing.kernels.tp_check", description=__doc__.split("\n")[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--model", help="HF model dir (default: the tiny 8-q / 4-KV-head llama, built here)")
    args = ap.parse_args(argv)
    count = torch.cuda.device_count() if args.device == "cuda" else 0
    reason = skip_reason(args.device, args.world, count)
    if reason:
        print(reason)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else None
        if model_dir is None:
            from executor_svc.tiny_model import build_tiny_model

            model_dir = build_tiny_model(Path(tmp) / "tiny-tp", "llama", "tp")
        return 0 if check(model_dir, args.device, args.world) else 1


if __name__ == "__main__":
    sys.exit(main())
