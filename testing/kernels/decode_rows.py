"""The decode rows of ``make gpu-check`` (benchmarks/kernels/bench.py): what a row holds, how every
decode variant is checked and timed on its problem, and the markdown table. Apart from the timing
itself, so that the tests check the bookkeeping that picks a variant on the CPU."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch


@dataclass(slots=True)
class DecodeRow:
    batch: int
    context: int
    partitions: int
    kv_bytes: int
    kernel_us: float
    sdpa_us: float
    achieved_gbs: float
    frac_of_read: float  # achieved read bandwidth / measured read-only bandwidth
    vs_sdpa: float  # kernel time / SDPA time
    variants_us: dict[str, float] = field(default_factory=dict)  # every decode variant's time
    variant_parts: dict[str, int] = field(default_factory=dict)  # the partitions each variant ran
    variants_wrong: list[str] = field(default_factory=list)  # output off the default's: not timed
    best_variant: str = ""  # the fastest correct variant ("" when none was timed)

    @property
    def best_us(self) -> float:
        return self.variants_us.get(self.best_variant, self.kernel_us)

    def as_dict(self) -> dict:
        return {**asdict(self), "best_us": self.best_us}


def fastest(variants_us: dict[str, float]) -> str:
    """The variant with the least time ("" for none); ties go to the first listed (the default)."""
    return min(variants_us, key=lambda v: variants_us[v], default="")


def time_variants(ours: Callable[..., None], out: torch.Tensor, auto_us: float,
                  time_us: Callable[[Callable[[], object]], float]) -> tuple[dict, list]:
    """({variant: us}, [variants whose output is off]) on the problem ``ours(variant, rotate)`` runs;
    the one "auto" runs keeps ``auto_us``; ``time_us`` times a call (the benchmark's CUDA events).
    Each variant's output on one table set is checked against the default's first, so a broken
    variant cannot win by skipping work; one that raises is listed as wrong too."""
    from cupy_kernels.launchers import DECODE_VARIANTS, decode_variant

    times, wrong = {}, []
    ours("auto", rotate=False)
    want = out.float().clone()
    for name, spec in DECODE_VARIANTS.items():
        if spec is decode_variant("auto"):
            times[name] = auto_us
            continue
        out.fill_(float("nan"))
        try:
            ours(name, rotate=False)
            err = float((out.float() - want).norm() / want.norm())
            if not err < 2e-2:  # bf16 roundings of two summation orders differ by ~1e-3; NaN fails too
                wrong.append(f"{name} (rel. error {err:.3g} against auto)")
                continue
            times[name] = time_us(lambda name=name: ours(name))
        except Exception as exc:  # noqa: BLE001  a variant that raises is reported; the others are still timed
            wrong.append(f"{name} (raised {type(exc).__name__}: {exc})")
    return times, wrong


def markdown(rows: list[DecodeRow], read_gbs: float, device: str) -> str:
    lines = [f"Decode attention, Llama-3-8B shapes (32 q heads, 8 KV heads, head 128, bf16, block 16) on "
             f"{device}; read-only bandwidth {read_gbs:.0f} GB/s. \"ours\" is the default (auto) kernel; "
             f"\"best\" the fastest decode variant.", "",
             "| batch | context | partitions | K/V MB | ours (us) | SDPA contiguous (us) | achieved GB/s "
             "| of read BW | ours / SDPA | best variant (us) | best / SDPA |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    for r in rows:
        lines.append(f"| {r.batch} | {r.context} | {r.partitions} | {r.kv_bytes / 1e6:.1f} | {r.kernel_us:.1f} "
                     f"| {r.sdpa_us:.1f} | {r.achieved_gbs:.0f} | {100 * r.frac_of_read:.0f}% "
                     f"| {r.vs_sdpa:.2f}x | {r.best_variant or '-'} ({r.best_us:.1f}) | {r.best_us / r.sdpa_us:.2f}x |")
    timed = [r for r in rows if r.variants_us]
    if timed:
        names = list(dict.fromkeys(n for r in timed for n in r.variants_us))
        lines += ["", "Every decode variant (us; launchers.DECODE_VARIANTS):", "",
                  "| batch | context | " + " | ".join(names) + " |", "|---:|---:|" + "---:|" * len(names)]
        lines += [f"| {r.batch} | {r.context} | " + " | ".join(
            f"{r.variants_us[n]:.1f}" if n in r.variants_us else "-" for n in names) + " |" for r in timed]
    wrong = [f"{r.batch} x {r.context}: {w}" for r in rows for w in r.variants_wrong]
    if wrong:
        lines += ["", "Variants not timed, output off the default's: " + "; ".join(wrong)]
    return "\n".join(lines)
