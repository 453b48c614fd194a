"""The report of ``make gpu-check`` (benchmarks/kernels/gpu_check.py): #45's bars, the PASS/MISS
verdicts, and the files a run leaves. Apart from the GPU work, so the tests check on the CPU that a
section which raises, a budget that runs out or a run cut short keeps every figure measured before it."""

from __future__ import annotations

import json
import math
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

MODEL_NAME = "llama-1.1b-shape"

# Issue #45's bars: decode attention against SDPA per shape, of the read bandwidth, prefill
# attention against SDPA, and the 1.1B shape's decode step with graphs.
TARGET_DECODE_VS_SDPA = {(64, 2048): 1.05, (8, 8192): 1.05, (1, 2048): 1.2}
TARGET_FRAC_OF_READ = 0.85  # at batch 64, context 2048
TARGET_PREFILL_VS_SDPA = 1.2
TARGET_STEP_MS = {1: 1.0, 64: 1.5}
TARGET_BUSY = 0.85
TARGET_STACK_TOK_S = {1: 400, 64: 25_000}
# Seconds a section takes on an H200, rounded up: with --budget-s, one that would not fit is skipped.
NEEDS_S = {"tests": 60, "decode": 60, "prefill": 15, "model": 20, "decode_step": 60, "graphs_greedy_equal": 30,
           "prefill_step": 40, "stack": 120, "device_idle": 25, "device_idle_prepare_ahead": 25,
           "tensor_parallel": 60}


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


@dataclass(slots=True)
class PrefillRow:
    """Milliseconds per call; None for a kernel that raised (its message in ``errors``)."""

    case: str  # "<sequences>x<tokens>"
    ours_ms: float | None  # the launcher's default kernel (tensor cores for f16/bf16)
    sdpa_ms: float
    simt_ms: float | None  # the SIMT prefill kernel on the same problem (kernel="simt")
    pipe_ms: float | None  # the tensor-core kernel with cp.async-pipelined K/V tiles (kernel="mma_pipe")
    errors: dict[str, str] = field(default_factory=dict)  # kernel -> what it raised

    def as_dict(self) -> dict:
        return asdict(self)
