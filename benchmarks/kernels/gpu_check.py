"""``make gpu-check`` / ``python -m benchmarks.kernels.gpu_check``: everything that needs a GPU, in one run.

1. the GPU tests (``pytest -m gpu``): every kernel against its float64 reference over the dtype /
   head size / block size / GQA grid, the CuPy backend against the torch backend, and greedy
   generation of the tiny model on the GPU path against the CPU path and transformers;
2. decode-attention timing at Llama-3-8B shapes (batch 1/8/64 x context 512/2048/8192): achieved
   bandwidth against the measured read-only bandwidth, and time against torch SDPA; prefill
   attention at 1 x 4096 and 8 x 1024 fresh tokens against SDPA's causal attention (the default,
   tensor-core kernel as ``ours_ms``, the SIMT kernel as ``simt_ms``, the pipelined tensor-core
   kernel as ``pipe_ms``);
3. whole executor steps on a 1.1B-shaped Llama written at run time
   (testing/kernels/executor_steps.py): decode steps at 1/64/256 sequences with CUDA graphs
   off and on, whether graphs keep the greedy tokens, and a 16 x 1024 prefill step against
   transformers' forward;
4. the whole stack on that model (testing/stack_throughput.py): a scheduler process and an
   executor process, greedy gRPC streams of 128 tokens at 1, 64 and 256 streams, tokens per second;
5. the executor's idle device time per decode step on the default tiny model, and, with two GPUs,
   a tensor-parallel group of 2 ranks (NCCL all-reduces, the CuPy kernels with per-rank head
   counts) generating greedily against transformers (testing/kernels/tp_check.py); with one GPU it
   is skipped with a message saying so.

Results go to ``--out`` (default ``$OUT``, else ``build/gpu_check/``) as ``gpu_check.json`` and
``gpu_check.md`` (ready for docs/PERF.md), both rewritten after every section and every decode
row, so a run cut short keeps what it measured. A section that raises is reported as an error
and the rest still run; with ``--budget-s`` a section that would not finish in the time left is
reported as skipped. Sections run in the order of what #45's figures need most. Exit status 1 if
a test or the tensor-parallel check failed. Designed to finish in about 6 minutes on an H200.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from pathlib import Path

from testing.kernels.gpu_report import MODEL_NAME, CheckRun, error_of
from testing.kernels.tp_check import run_command, run_tp_check

BATCHES = (1, 8, 64)
CONTEXTS = (512, 2048, 8192)
PREFILL_CASES = ((1, 4096), (8, 1024))
# The executor of the stack: the model's bfloat16 weights, CUDA graphs on (the default); half the GPU,
# since this process keeps what its own timings allocated.
STACK_EXECUTOR_ARGS = ("--device", "cuda", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.5")

def gpu_test_files() -> list[str]:
    """Test files that carry GPU tests, marked in the file or through a fixture of their folder's
    conftest.py (collecting only these keeps unrelated imports out)."""
    def marks(p: Path) -> bool:
        return p.is_file() and "mark.gpu" in p.read_text()

    return sorted(str(p) for p in Path("tests").rglob("test_*.py") if marks(p) or marks(p.parent / "conftest.py"))


def run_gpu_tests(timeout_s: int) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *gpu_test_files()]
    return run_command(cmd, timeout_s)


def device_info() -> dict:
    import cupy
    import torch
    import transformers

    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30),
            "torch": torch.__version__, "cupy": cupy.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "python": sys.version.split()[0]}


def run_decode(run: CheckRun) -> list[dict]:
    """Every decode row (each row saved as it ends; one that raises is an error row)."""
    import torch

    from benchmarks.kernels.bench import decode_row, read_bandwidth_gbs

    run.report["read_bandwidth_gbs"] = read_gbs = read_bandwidth_gbs()
    rows: list[dict] = []
    run.report["decode"] = rows
    for batch in BATCHES:
        for ctx in CONTEXTS:
            try:
                row = decode_row(batch, ctx, read_gbs)
                run.decode_rows.append(row)
                rows.append(row.as_dict())
                print(f"  batch {batch:3d} context {ctx:5d}: {row.kernel_us:8.1f} us (best variant "
                      f"{row.best_variant}: {row.best_us:.1f} us)", flush=True)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                rows.append({"batch": batch, "context": ctx, **error_of(exc)})
            torch.cuda.empty_cache()  # the row's caches are gone; give their memory back
            run.save()
    return rows


def run_prefill(run: CheckRun) -> list[dict]:
    import torch

    from benchmarks.kernels.bench import prefill_row

    rows: list[dict] = []
    for batch, tokens in PREFILL_CASES:
        try:
            row = prefill_row(batch, tokens)
            run.prefill_rows.append(row)
            rows.append(row.as_dict())
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"case": f"{batch}x{tokens}", **error_of(exc)})
        torch.cuda.empty_cache()
        print(f"  prefill {rows[-1]}", flush=True)
    return rows


def run_executor_sections(run: CheckRun, model_root: Path) -> None:
    """Sections 3 and 4 on the 1.1B-shaped model, written once into ``model_root``."""
    import torch

    from testing import stack_throughput
    from testing.kernels import executor_steps
    from testing.shaped_models import SHAPES, write_word_tokenizer

    written = run.section("model", lambda: str(executor_steps.write_model(model_root)))
    if not isinstance(written, str):
        return
    model_dir = Path(written)

    loaded: list = []  # the model, loaded once by the first section that needs it (2.2 GB read each time)

    def model() -> object:
        if not loaded:
            loaded.append(executor_steps.load(model_dir))
        return loaded[0]

    def stack() -> list[dict]:
        loaded.clear()
        torch.cuda.empty_cache()  # the executor process sizes its KV cache from what is free
        write_word_tokenizer(model_dir, SHAPES[MODEL_NAME]["vocab_size"])
        return stack_throughput.measure(model_dir, list(STACK_EXECUTOR_ARGS), model_name=MODEL_NAME)

    run.section("decode_step", lambda: executor_steps.decode_steps(model_dir, model()))
    run.section("graphs_greedy_equal", lambda: executor_steps.graphs_greedy_equal(model_dir, model()))
    run.section("prefill_step", lambda: executor_steps.prefill_step(model_dir, model()))
    run.section("stack", stack)


def run_device_idle(prepare_ahead: bool) -> dict:
    """The executor's host work per decode step that leaves the GPU idle (testing/device_idle.py),
    on the default tiny model, 64 sequences; one plan at a time, or each prepared while the step
    before runs (``--prepare-ahead``)."""
    import tempfile

    from executor_svc.tiny_model import build_tiny_model
    from testing.device_idle import measure

    with tempfile.TemporaryDirectory() as d:
        return measure(build_tiny_model(Path(d), "llama", "default"), "cuda", seqs=64, prompt=128, steps=30,
                       prepare_ahead=prepare_ahead)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "build/gpu_check", help="results directory")
    parser.add_argument("--test-timeout", type=int, default=240, help="seconds for the GPU tests")
    parser.add_argument("--skip-tests", action="store_true", help="timing only")
    parser.add_argument("--budget-s", type=float, help="seconds the whole run may take: a section that would not "
                                                       "finish in what is left is skipped (a leased machine's limit)")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; nothing to check", file=sys.stderr)
        return 2
    run = CheckRun(Path(args.out), args.budget_s)
    run.section("info", device_info)
    print("device:", run.report["info"], flush=True)
    if not args.skip_tests:
        print("running GPU tests ...", flush=True)
        tests = run.section("tests", lambda: run_gpu_tests(int(max(30, min(args.test_timeout, run.left_s() - 240)))))
        print(tests.get("tail", ""), flush=True)
    print("timing decode attention ...", flush=True)
    run.section("decode", lambda: run_decode(run))
    print("timing prefill attention ...", flush=True)
    run.section("prefill", lambda: run_prefill(run))
    print(f"executor steps on a {MODEL_NAME} model ...", flush=True)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        run_executor_sections(run, Path(d))
    from benchmarks.kernels.bench import copy_bandwidth_gbs

    run.section("copy_bandwidth_gbs", copy_bandwidth_gbs)
    print("device idle per step inside the executor ...", flush=True)
    run.section("device_idle", lambda: run_device_idle(prepare_ahead=False))
    run.section("device_idle_prepare_ahead", lambda: run_device_idle(prepare_ahead=True))
    if not args.skip_tests:
        print("tensor-parallel check ...", flush=True)
        tp = run.section("tensor_parallel", lambda: run_tp_check(args.test_timeout, torch.cuda.device_count()))
        print(tp.get("skipped") or tp.get("tail") or tp.get("error"), flush=True)
    print("\n" + run.markdown())
    tests_rc = run.report.get("tests", {}).get("returncode", 0 if args.skip_tests else 1)
    tp_rc = run.report.get("tensor_parallel", {}).get("returncode", 0 if args.skip_tests else 1)
    print(f"GPU tests: {'passed' if tests_rc == 0 else f'FAILED (rc {tests_rc})'}")
    tp = run.report.get("tensor_parallel", {})
    print(f"tensor-parallel N = 2: {tp.get('skipped') or ('passed' if tp_rc == 0 else 'FAILED')}")
    return 0 if tests_rc == 0 and tp_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
