"""The report of ``make gpu-check`` (testing/kernels/gpu_report.py) around the GPU work, on the CPU:
a leased GPU runs it once, for minutes, so a section that raises, a budget that runs out or a run
killed midway must still leave every figure measured before it in gpu_check.json and .md."""

from __future__ import annotations

import json
import sys
import time

from testing.kernels import gpu_report
from testing.kernels.decode_rows import DecodeRow
from testing.kernels.gpu_report import PrefillRow
from testing.kernels.tp_check import run_command


def _saved(out) -> tuple[dict, str]:
    return json.loads((out / "gpu_check.json").read_text()), (out / "gpu_check.md").read_text()


def test_a_section_that_raises_is_an_error_and_the_files_keep_the_rest(tmp_path):
    run = gpu_report.CheckRun(tmp_path)
    run.section("info", lambda: {"device": "H200"})
    run.decode_rows.append(DecodeRow(64, 2048, 2, 10 ** 8, 40.0, 32.0, 2500.0, 0.6, 1.25))
    run.report["read_bandwidth_gbs"] = 4000.0
    run.section("decode", lambda: [run.decode_rows[0].as_dict()])
    assert run.section("decode_step", lambda: 1 / 0) == {"error": "ZeroDivisionError: division by zero"}
    report, md = _saved(tmp_path)  # written as each section ended, before the run is over
    assert report["decode"][0]["kernel_us"] == 40.0 and report["decode_step"] == {"error": "ZeroDivisionError: division by zero"}
    assert "MISS decode attention 64 x 2048: 1.25x SDPA" in md and "| 64 | 2048 | 2 |" in md
    assert "- decode_step: ZeroDivisionError: division by zero" in md


def test_the_budget_skips_what_would_not_finish_and_says_so(tmp_path):
    run = gpu_report.CheckRun(tmp_path, budget_s=30)
    ran = []
    run.section("prefill", lambda: ran.append("prefill") or [])  # needs ~15 s: runs
    run.section("stack", lambda: ran.append("stack") or [])  # needs ~120 s: skipped
    assert ran == ["prefill"]
    assert run.report["stack"]["skipped"].startswith("--budget-s:")
    assert "- stack: --budget-s:" in _saved(tmp_path)[1]


def test_verdicts_take_failed_sections_and_failed_kernels():
    report = {"decode_step": {"error": "OutOfMemoryError: ..."}, "graphs_greedy_equal": {"error": "x"},
              "prefill_step": {"skipped": "--budget-s"}, "stack": {"error": "y"}}
    prefill = [PrefillRow("1x4096", 0.5, 0.4, 6.0, None, {"mma_pipe": "CUDADriverError: ..."}),
               PrefillRow("8x1024", None, 0.2, 3.0, None)]
    assert gpu_report.verdicts(report, [], prefill) == [
        "MISS prefill attention 1x4096: 1.25x SDPA (target <= 1.2x; pipelined failed, SIMT kernel 15.00x)"]
    report = {"decode_step": [{"seqs": 1, "graphs": True, "wall_ms": 0.9, "busy_ms": 0.8},
                              {"seqs": 64, "graphs": True, "error": "RuntimeError: capture"},
                              {"seqs": 64, "graphs": False, "wall_ms": 9.0, "busy_ms": 2.0}],
              "graphs_greedy_equal": True, "stack": [{"streams": 1, "tok_s": 512.0}, {"streams": 64, "error": "z"}]}
    assert gpu_report.verdicts(report, [], []) == [
        "PASS decode step llama-1.1b-shape 1 seqs with graphs: 0.9 ms (target <= 1.0 ms)",
        "PASS GPU busy, 1 seqs with graphs: 89% (target >= 85%)",
        "PASS greedy tokens equal with and without graphs",
        "PASS whole stack llama-1.1b-shape, 1 streams: 512 tok/s (target >= 400)"]


def test_run_command_keeps_a_timed_out_commands_lines_and_kills_its_children():
    code = ("import subprocess, sys, time\n"
            "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print('line 0', flush=True); print('to stderr', file=sys.stderr, flush=True); time.sleep(60)")
    start = time.monotonic()
    got = run_command([sys.executable, "-c", code], timeout_s=3)
    assert time.monotonic() - start < 20  # the grandchild holds the pipe unless the group is killed
    assert got["returncode"] == 124
    assert got["tail"].splitlines() == ["timed out after 3s", "line 0", "to stderr"]
    ok = run_command([sys.executable, "-c", "print('done')"], timeout_s=30)
    assert ok["returncode"] == 0 and ok["tail"] == "done"
