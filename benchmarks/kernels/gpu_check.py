"""``make gpu-check`` / ``python -m benchmarks.kernels.gpu_check``: everything that needs a GPU, in one run.

1. the GPU tests (``pytest -m gpu``): every kernel against its float64 reference over the dtype /
   head size / block size / GQA grid, the CuPy backend against the torch backend, and greedy
   generation of the tiny model on the GPU path against the CPU path and transformers;
2. with two GPUs, a tensor-parallel group of 2 ranks (NCCL all-reduces, the CuPy kernels with
   per-rank head counts) generating greedily against transformers (testing/kernels/tp_check.py);
   with one GPU it is skipped with a message saying so;
3. decode-attention timing at Llama-3-8B shapes (batch 1/8/64 x context 512/2048/8192): achieved
   bandwidth against the measured read-only bandwidth, and time against torch SDPA; prefill
   attention at 1 x 4096 and 8 x 1024 fresh tokens against SDPA's causal attention (the default,
   tensor-core kernel as ``ours_ms``, the SIMT kernel as ``simt_ms``, the pipelined tensor-core
   kernel as ``pipe_ms``);
4. whole executor steps on a 1.1B-shaped Llama written at run time
   (benchmarks/kernels/executor_steps.py): decode steps at 1/64/256 sequences with CUDA graphs
   off and on, whether graphs keep the greedy tokens, and a 16 x 1024 prefill step against
   transformers' forward;
5. the whole stack on that model (testing/stack_throughput.py): a scheduler process and an
   executor process, greedy gRPC streams of 128 tokens at 1, 64 and 256 streams, tokens per second.

Results go to ``--out`` (default ``$OUT``, else ``build/gpu_check/``) as ``gpu_check.json`` and
``gpu_check.md`` (ready for docs/PERF.md); the table is printed last. Exit status 1 if a test
or the tensor-parallel check failed. Designed to finish in well under 6 minutes on an H200.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from testing.kernels.tp_check import run_command, run_tp_check

MODEL_NAME = "llama-1.1b-shape"

BATCHES = (1, 8, 64)
CONTEXTS = (512, 2048, 8192)
PREFILL_CASES = ((1, 4096), (8, 1024))
# Issue #45's bars: decode attention against SDPA per shape, of the read bandwidth, prefill
# attention against SDPA, and the 1.1B shape's decode step with graphs.
TARGET_DECODE_VS_SDPA = {(64, 2048): 1.05, (8, 8192): 1.05, (1, 2048): 1.2}
TARGET_FRAC_OF_READ = 0.85  # at batch 64, context 2048
TARGET_PREFILL_VS_SDPA = 1.2
TARGET_STEP_MS = {1: 1.0, 64: 1.5}
TARGET_BUSY = 0.85
TARGET_STACK_TOK_S = {1: 400, 64: 25_000}
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

    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30),
            "torch": torch.__version__, "cupy": cupy.__version__, "cuda": torch.version.cuda}


def run_bench() -> tuple[float, list]:
    import torch

    from benchmarks.kernels.bench import decode_row, read_bandwidth_gbs

    read_gbs = read_bandwidth_gbs()
    rows = []
    for batch in BATCHES:
        for ctx in CONTEXTS:
            rows.append(decode_row(batch, ctx, read_gbs))
            torch.cuda.empty_cache()  # the row's caches are gone; give their memory back
            print(f"  batch {batch:3d} context {ctx:5d}: {rows[-1].kernel_us:8.1f} us (best variant "
                  f"{rows[-1].best_variant}: {rows[-1].best_us:.1f} us)", flush=True)
    return read_gbs, rows


def run_prefill() -> list:
    import torch

    from benchmarks.kernels.bench import prefill_row

    rows = []
    for batch, tokens in PREFILL_CASES:
        rows.append(prefill_row(batch, tokens))
        torch.cuda.empty_cache()
        print(f"  prefill {rows[-1]}", flush=True)
    return rows


def run_executor_steps(report: dict) -> None:
    """Sections 4 and 5 into ``report``; a failing part is reported as an error and the rest still run."""
    import tempfile

    import torch

    from benchmarks.kernels import executor_steps
    from testing import stack_throughput
    from testing.shaped_models import SHAPES, write_word_tokenizer

    def stack(model_dir: Path) -> list[dict]:
        torch.cuda.empty_cache()  # the executor process sizes its KV cache from what is free
        write_word_tokenizer(model_dir, SHAPES[MODEL_NAME]["vocab_size"])
        return stack_throughput.measure(model_dir, list(STACK_EXECUTOR_ARGS), model_name=MODEL_NAME)

    with tempfile.TemporaryDirectory() as d:
        model_dir = executor_steps.write_model(Path(d))
        for key, fn in (("decode_step", executor_steps.decode_steps),
                        ("graphs_greedy_equal", executor_steps.graphs_greedy_equal),
                        ("prefill_step", executor_steps.prefill_step),
                        ("stack", stack)):
            try:
                report[key] = fn(model_dir)
            except Exception as exc:  # noqa: BLE001
                report[key] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"{key}: {report[key]}", flush=True)


def run_device_idle(prepare_ahead: bool) -> dict:
    """The executor's host work per decode step that leaves the GPU idle (testing/device_idle.py),
    on the default tiny model, 64 sequences; one plan at a time, or each prepared while the step
    before runs (``--prepare-ahead``)."""
    import tempfile

    from executor_svc.tiny_model import build_tiny_model
    from testing.device_idle import measure

    try:
        with tempfile.TemporaryDirectory() as d:
            return measure(build_tiny_model(Path(d), "llama", "default"), "cuda", seqs=64, prompt=128, steps=30,
                           prepare_ahead=prepare_ahead)
    except Exception as exc:  # report it; the kernel table still matters
        return {"error": f"{type(exc).__name__}: {exc}"}


def _bar(ok: bool, text: str) -> str:
    return f"{'PASS' if ok else 'MISS'} {text}"


def verdicts(report: dict, rows: list, prefill: list) -> list[str]:
    out = []
    for r in rows:
        target = TARGET_DECODE_VS_SDPA.get((r.batch, r.context))
        if target is not None:
            out.append(_bar(r.vs_sdpa <= target, f"decode attention {r.batch} x {r.context}: {r.vs_sdpa:.2f}x SDPA "
                                                 f"(target <= {target}x; best variant {r.best_variant} "
                                                 f"{r.best_us / r.sdpa_us:.2f}x)"))
        if (r.batch, r.context) == (64, 2048):
            out.append(_bar(r.frac_of_read >= TARGET_FRAC_OF_READ,
                            f"decode attention 64 x 2048: {100 * r.frac_of_read:.0f}% of read bandwidth "
                            f"(target >= {100 * TARGET_FRAC_OF_READ:.0f}%)"))
    for p in prefill:
        ratio = p.ours_ms / p.sdpa_ms
        out.append(_bar(ratio <= TARGET_PREFILL_VS_SDPA, f"prefill attention {p.case}: {ratio:.2f}x SDPA "
                                                         f"(target <= {TARGET_PREFILL_VS_SDPA}x; pipelined "
                                                         f"{p.pipe_ms / p.sdpa_ms:.2f}x, SIMT kernel "
                                                         f"{p.simt_ms / p.sdpa_ms:.2f}x)"))
    for row in report.get("decode_step", []):
        if row.get("graphs") and "wall_ms" in row:
            target = TARGET_STEP_MS.get(row["seqs"])
            if target is not None:
                out.append(_bar(row["wall_ms"] <= target, f"decode step {MODEL_NAME} {row['seqs']} seqs with graphs: "
                                                           f"{row['wall_ms']} ms (target <= {target} ms)"))
            busy = row["busy_ms"] / row["wall_ms"]
            out.append(_bar(busy >= TARGET_BUSY, f"GPU busy, {row['seqs']} seqs with graphs: {100 * busy:.0f}% "
                                                  f"(target >= {100 * TARGET_BUSY:.0f}%)"))
    if "graphs_greedy_equal" in report:
        out.append(_bar(report["graphs_greedy_equal"] is True, "greedy tokens equal with and without graphs"))
    step = report.get("prefill_step", {})
    if "tok_s" in step:
        out.append(_bar(step["tok_s"] > step["hf_tok_s"], f"prefill step 16 x 1024: {step['tok_s']} tok/s against "
                                                          f"transformers' {step['hf_tok_s']}"))
    for row in report.get("stack", []) if isinstance(report.get("stack"), list) else []:
        target = TARGET_STACK_TOK_S.get(row["streams"])
        if target is not None:
            out.append(_bar(row["tok_s"] >= target, f"whole stack {MODEL_NAME}, {row['streams']} streams: "
                                                    f"{row['tok_s']:.0f} tok/s (target >= {target})"))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT") or "build/gpu_check", help="results directory")
    parser.add_argument("--test-timeout", type=int, default=240, help="seconds for the GPU tests")
    parser.add_argument("--skip-tests", action="store_true", help="timing only")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible to torch; nothing to check", file=sys.stderr)
        return 2
    report: dict = {"info": device_info()}
    print("device:", report["info"], flush=True)
    if not args.skip_tests:
        print("running GPU tests ...", flush=True)
        report["tests"] = run_gpu_tests(args.test_timeout)
        print(report["tests"]["tail"], flush=True)
        (out / "gpu_check.json").write_text(json.dumps(report, indent=2))  # keep partial results
        print("tensor-parallel check ...", flush=True)
        report["tensor_parallel"] = run_tp_check(args.test_timeout, torch.cuda.device_count())
        print(report["tensor_parallel"].get("skipped") or report["tensor_parallel"]["tail"], flush=True)
    from benchmarks.kernels.bench import markdown

    print("device idle per step inside the executor ...", flush=True)
    report["device_idle"] = run_device_idle(prepare_ahead=False)
    report["device_idle_prepare_ahead"] = run_device_idle(prepare_ahead=True)
    print(report["device_idle"], report["device_idle_prepare_ahead"], sep="\n", flush=True)
    print("timing decode attention ...", flush=True)
    from benchmarks.kernels.bench import copy_bandwidth_gbs

    read_gbs, rows = run_bench()
    report["read_bandwidth_gbs"] = read_gbs
    report["copy_bandwidth_gbs"] = copy_bandwidth_gbs()
    report["decode"] = [r.as_dict() for r in rows]
    print("timing prefill attention ...", flush=True)
    prefill = run_prefill()
    report["prefill"] = [p.as_dict() for p in prefill]
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"executor steps on a {MODEL_NAME} model ...", flush=True)
    run_executor_steps(report)
    report["verdicts"] = verdicts(report, rows, prefill)
    table = markdown(rows, read_gbs, report["info"]["device"])
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    idle_lines = [
        (f"Executor, 64 sequences decoding (default tiny model), {how}: {idle['wall_ms_per_step']} ms per step, "
         f"GPU busy {idle['busy_ms_per_step']} ms, idle {idle['idle_ms_per_step']} ms ({100 * idle['idle_frac']:.0f}%), "
         f"batch layout {idle['build_ms_per_step']} ms of host work"
         if "error" not in idle else f"device idle ({how}): {idle['error']}")
        for how, idle in (("one plan at a time", report["device_idle"]),
                          ("each plan prepared ahead", report["device_idle_prepare_ahead"]))]
    (out / "gpu_check.md").write_text(table + "\n\n" + "\n".join(report["verdicts"]) + "\n\n"
                                      + "\n".join(idle_lines) + "\n")
    tests = report.get("tests", {"returncode": 0})
    tp = report.get("tensor_parallel", {"returncode": 0})
    print("\n" + table + "\n\n" + "\n".join(report["verdicts"]))
    status = "passed" if tests["returncode"] == 0 else f"FAILED (rc {tests['returncode']})"
    print(f"GPU tests: {status}")
    print(f"tensor-parallel N = 2: {tp.get('skipped') or ('passed' if tp['returncode'] == 0 else 'FAILED')}")
    return 0 if tests["returncode"] == 0 and tp["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
