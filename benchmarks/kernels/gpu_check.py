"""``make gpu-check`` / ``python -m benchmarks.kernels.gpu_check``: everything that needs a GPU, in one run.

1. the GPU tests (``pytest -m gpu``): every kernel against its float64 reference over the dtype /
   head size / block size / GQA grid, the CuPy backend against the torch backend, and greedy
   generation of the tiny model on the GPU path against the CPU path and transformers;
2. with two GPUs, a tensor-parallel group of 2 ranks (NCCL all-reduces, the CuPy kernels with
   per-rank head counts) generating greedily against transformers (testing/kernels/tp_check.py);
   with one GPU it is skipped with a message saying so;
3. decode-attention timing at Llama-3-8B shapes (batch 1/8/64 x context 512/2048/8192): achieved
   bandwidth against the measured device copy bandwidth, and time against torch SDPA.

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

BATCHES = (1, 8, 64)
CONTEXTS = (512, 2048, 8192)
TARGET_FRAC_OF_COPY = 0.70  # at batch 64, context 2048
TARGET_VS_SDPA = 1.25


def gpu_test_files() -> list[str]:
    """Test files that carry GPU tests (collecting only these keeps unrelated imports out)."""
    return sorted(str(p) for p in Path("tests").rglob("test_*.py") if "mark.gpu" in p.read_text())


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

    from benchmarks.kernels.bench import copy_bandwidth_gbs, decode_row

    copy_gbs = copy_bandwidth_gbs()
    rows = []
    for batch in BATCHES:
        for ctx in CONTEXTS:
            rows.append(decode_row(batch, ctx, copy_gbs))
            torch.cuda.empty_cache()  # the row's caches are gone; give their memory back
            print(f"  batch {batch:3d} context {ctx:5d}: {rows[-1].kernel_us:8.1f} us", flush=True)
    return copy_gbs, rows


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


def verdicts(rows: list) -> list[str]:
    out = []
    for r in rows:
        if r.batch == 64 and r.context == 2048:
            ok = r.frac_of_copy >= TARGET_FRAC_OF_COPY
            out.append(f"{'PASS' if ok else 'MISS'} bandwidth at batch 64, context 2048: "
                       f"{100 * r.frac_of_copy:.0f}% of copy (target >= {100 * TARGET_FRAC_OF_COPY:.0f}%)")
            ok = r.vs_sdpa <= TARGET_VS_SDPA
            out.append(f"{'PASS' if ok else 'MISS'} vs SDPA at batch 64, context 2048: {r.vs_sdpa:.2f}x "
                       f"(target <= {TARGET_VS_SDPA}x)")
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
    copy_gbs, rows = run_bench()
    report["copy_bandwidth_gbs"] = copy_gbs
    report["decode"] = [r.as_dict() for r in rows]
    report["verdicts"] = verdicts(rows)
    table = markdown(rows, copy_gbs, report["info"]["device"])
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2))
    idle_lines = [
        (f"Executor, 64 sequences decoding (default tiny model), {how}: {idle['wall_ms_per_step']} ms per step, "
         f"GPU busy {idle['busy_ms_per_step']} ms, idle {idle['idle_ms_per_step']} ms ({100 * idle['idle_frac']:.0f}%)"
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
