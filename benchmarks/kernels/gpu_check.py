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
   (benchmarks/kernels/executor_steps.py): decode steps at 1/64/256 sequences with CUDA graphs
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
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Callable
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
# Seconds a section takes on an H200, rounded up: with --budget-s, one that would not fit is skipped.
NEEDS_S = {"tests": 60, "decode": 60, "prefill": 15, "model": 20, "decode_step": 60, "graphs_greedy_equal": 30,
           "prefill_step": 40, "stack": 120, "device_idle": 25, "device_idle_prepare_ahead": 25,
           "tensor_parallel": 60}


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


def error_of(exc: BaseException) -> dict:
    return {"error": f"{type(exc).__name__}: {exc}"}


class CheckRun:
    """The report of one run: every section stored under its key as it ends (a result, ``{"error"}``
    or ``{"skipped"}``), and both files rewritten from whatever is there by then."""

    def __init__(self, out: Path, budget_s: float | None = None) -> None:
        self.out = out
        self.deadline = None if budget_s is None else time.monotonic() + budget_s
        self.report: dict = {}
        self.decode_rows: list = []  # DecodeRow, for the markdown table and the verdicts
        self.prefill_rows: list = []  # PrefillRow

    def left_s(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.monotonic()

    def section(self, key: str, fn: Callable[[], object]) -> object:
        """``report[key] = fn()``; an exception, or too little time left, is stored instead."""
        need = NEEDS_S.get(key, 0)
        if self.left_s() < need:
            self.report[key] = {"skipped": f"--budget-s: {max(0.0, self.left_s()):.0f} s left, the section takes "
                                           f"about {need} s"}
        else:
            start = time.monotonic()
            try:
                self.report[key] = fn()
            except Exception as exc:  # noqa: BLE001  report it; the other sections still run
                traceback.print_exc()
                self.report[key] = error_of(exc)
            print(f"{key} ({time.monotonic() - start:.0f} s): {self.report[key]}", flush=True)
        self.save()
        return self.report[key]

    def markdown(self) -> str:
        from testing.kernels.decode_rows import markdown

        parts = []
        info = self.report.get("info", {})
        if self.decode_rows:
            parts.append(markdown(self.decode_rows, self.report.get("read_bandwidth_gbs", math.nan),
                                  info.get("device", "?")))
        parts.append("\n".join(verdicts(self.report, self.decode_rows, self.prefill_rows)))
        parts.append("\n".join(idle_lines(self.report)))
        problems = [f"{key}: {val['error'] if 'error' in val else val['skipped']}"
                    for key, val in self.report.items() if isinstance(val, dict) and ("error" in val or "skipped" in val)]
        if problems:
            parts.append("Sections not measured:\n" + "\n".join(f"- {p}" for p in problems))
        return "\n\n".join(p for p in parts if p) + "\n"

    def save(self) -> None:
        try:
            self.report["verdicts"] = verdicts(self.report, self.decode_rows, self.prefill_rows)
            md = self.markdown()
        except Exception as exc:  # noqa: BLE001  the JSON must still be written
            traceback.print_exc()
            self.report["verdicts"] = [f"verdicts failed: {type(exc).__name__}: {exc}"]
            md = "\n".join(self.report["verdicts"]) + "\n"
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "gpu_check.json").write_text(json.dumps(self.report, indent=2, default=str))
        (self.out / "gpu_check.md").write_text(md)


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

    from benchmarks.kernels import executor_steps
    from testing import stack_throughput
    from testing.shaped_models import SHAPES, write_word_tokenizer

    model = run.section("model", lambda: str(executor_steps.write_model(model_root)))
    if not isinstance(model, str):
        return
    model_dir = Path(model)

    def stack() -> list[dict]:
        torch.cuda.empty_cache()  # the executor process sizes its KV cache from what is free
        write_word_tokenizer(model_dir, SHAPES[MODEL_NAME]["vocab_size"])
        return stack_throughput.measure(model_dir, list(STACK_EXECUTOR_ARGS), model_name=MODEL_NAME)

    run.section("decode_step", lambda: executor_steps.decode_steps(model_dir))
    run.section("graphs_greedy_equal", lambda: executor_steps.graphs_greedy_equal(model_dir))
    run.section("prefill_step", lambda: executor_steps.prefill_step(model_dir))
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


def _bar(ok: bool, text: str) -> str:
    return f"{'PASS' if ok else 'MISS'} {text}"


def _dicts(value: object) -> list[dict]:
    """A section's rows, none when the section failed or was skipped (a dict, not a list)."""
    return [r for r in value if isinstance(r, dict)] if isinstance(value, list) else []


def verdicts(report: dict, rows: list, prefill: list) -> list[str]:
    """One PASS/MISS line per bar of #45 that this run measured; bars it did not measure get none."""
    out = []
    for r in rows:
        target = TARGET_DECODE_VS_SDPA.get((r.batch, r.context))
        if target is not None and r.sdpa_us > 0:
            out.append(_bar(r.vs_sdpa <= target, f"decode attention {r.batch} x {r.context}: {r.vs_sdpa:.2f}x SDPA "
                                                 f"(target <= {target}x; best variant {r.best_variant} "
                                                 f"{r.best_us / r.sdpa_us:.2f}x)"))
        if (r.batch, r.context) == (64, 2048):
            out.append(_bar(r.frac_of_read >= TARGET_FRAC_OF_READ,
                            f"decode attention 64 x 2048: {100 * r.frac_of_read:.0f}% of read bandwidth "
                            f"(target >= {100 * TARGET_FRAC_OF_READ:.0f}%)"))
    for p in prefill:
        if p.ours_ms is None or not p.sdpa_ms:
            continue
        others = ", ".join(f"{name} {ms / p.sdpa_ms:.2f}x" if ms is not None else f"{name} failed"
                           for name, ms in (("pipelined", p.pipe_ms), ("SIMT kernel", p.simt_ms)))
        ratio = p.ours_ms / p.sdpa_ms
        out.append(_bar(ratio <= TARGET_PREFILL_VS_SDPA, f"prefill attention {p.case}: {ratio:.2f}x SDPA "
                                                         f"(target <= {TARGET_PREFILL_VS_SDPA}x; {others})"))
    for row in _dicts(report.get("decode_step")):
        if row.get("graphs") and row.get("wall_ms"):
            target = TARGET_STEP_MS.get(row["seqs"])
            if target is not None:
                out.append(_bar(row["wall_ms"] <= target, f"decode step {MODEL_NAME} {row['seqs']} seqs with graphs: "
                                                           f"{row['wall_ms']} ms (target <= {target} ms)"))
            busy = row["busy_ms"] / row["wall_ms"]
            out.append(_bar(busy >= TARGET_BUSY, f"GPU busy, {row['seqs']} seqs with graphs: {100 * busy:.0f}% "
                                                  f"(target >= {100 * TARGET_BUSY:.0f}%)"))
    if isinstance(report.get("graphs_greedy_equal"), bool):
        out.append(_bar(report["graphs_greedy_equal"], "greedy tokens equal with and without graphs"))
    step = report.get("prefill_step")
    if isinstance(step, dict) and step.get("tok_s") and step.get("hf_tok_s"):
        out.append(_bar(step["tok_s"] > step["hf_tok_s"], f"prefill step 16 x 1024: {step['tok_s']} tok/s against "
                                                          f"transformers' {step['hf_tok_s']}"))
    for row in _dicts(report.get("stack")):
        target = TARGET_STACK_TOK_S.get(row.get("streams"))
        if target is not None and "tok_s" in row:
            out.append(_bar(row["tok_s"] >= target, f"whole stack {MODEL_NAME}, {row['streams']} streams: "
                                                    f"{row['tok_s']:.0f} tok/s (target >= {target})"))
    return out


def idle_lines(report: dict) -> list[str]:
    lines = []
    for key, how in (("device_idle", "one plan at a time"), ("device_idle_prepare_ahead", "each plan prepared ahead")):
        idle = report.get(key)
        if isinstance(idle, dict) and "wall_ms_per_step" in idle:
            lines.append(f"Executor, 64 sequences decoding (default tiny model), {how}: {idle['wall_ms_per_step']} ms "
                         f"per step, GPU busy {idle['busy_ms_per_step']} ms, idle {idle['idle_ms_per_step']} ms "
                         f"({100 * idle['idle_frac']:.0f}%), batch layout {idle['build_ms_per_step']} ms of host work")
    return lines


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
