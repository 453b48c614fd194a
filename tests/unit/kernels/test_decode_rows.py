"""CPU tests of the decode benchmark's variant bookkeeping (testing/kernels/decode_rows.py): which
variants get timed, which are rejected for a wrong output, the fastest, and the table make gpu-check
writes. The GPU run cannot be rehearsed here, so its Python is."""

from __future__ import annotations

import torch

from cupy_kernels.launchers import DECODE_VARIANTS
from testing.kernels import decode_rows as bench


def test_time_variants_checks_outputs_and_times_the_rest():
    want = torch.randn(4, 32, 128)
    out = torch.empty_like(want)
    ran = []

    def ours(variant: str = "auto", rotate: bool = True) -> None:
        ran.append((variant, rotate))
        out.copy_(torch.zeros_like(want) if variant == "nt2" else want + 1e-3 * (variant != "auto"))

    fake_us = {name: 10.0 + i for i, name in enumerate(DECODE_VARIANTS)} | {"pipe": 5.0}
    times, wrong = bench.time_variants(ours, out, 11.5, lambda fn: (fn(), fake_us[ran[-1][0]])[1])
    assert times["base"] == 11.5  # "auto" is base: its time is not taken twice
    assert ("base", False) not in ran and ("auto", False) in ran  # checks run on one fixed table set
    assert "nt2" not in times and wrong == ["nt2 (rel. error 1 against auto)"]
    assert set(times) == set(DECODE_VARIANTS) - {"nt2"}
    assert bench.fastest(times) == "pipe"
    assert bench.fastest({}) == "" and bench.fastest({"base": 3.0, "pipe": 3.0}) == "base"


def test_decode_row_dict_and_markdown_carry_every_variant():
    rows = [bench.DecodeRow(64, 2048, 2, 10 ** 8, 40.0, 32.0, 2500.0, 0.6, 1.25, {"base": 40.0, "pipe": 30.0},
                            {"base": 2, "pipe": 2}, ["nt2 (rel. error 1 against auto)"], "pipe"),
            bench.DecodeRow(1, 2048, 16, 10 ** 6, 8.0, 5.0, 125.0, 0.03, 1.6)]  # variants not timed
    d = rows[0].as_dict()
    assert d["variants_us"] == {"base": 40.0, "pipe": 30.0} and d["best_us"] == 30.0 and d["best_variant"] == "pipe"
    assert rows[1].best_us == 8.0
    table = bench.markdown(rows, 4000.0, "H200")
    assert "| 64 | 2048 | 2 | 100.0 | 40.0 | 32.0 | 2500 | 60% | 1.25x | pipe (30.0) | 0.94x |" in table
    assert "| 1 | 2048 | 16 | 1.0 | 8.0 | 5.0 | 125 | 3% | 1.60x | - (8.0) | 1.60x |" in table
    assert "| batch | context | base | pipe |" in table and "| 64 | 2048 | 40.0 | 30.0 |" in table
    assert "64 x 2048: nt2 (rel. error 1 against auto)" in table


def test_a_variant_that_raises_is_listed_and_the_others_are_timed():
    want = torch.randn(2, 32, 128)
    out = torch.empty_like(want)

    def ours(variant: str = "auto", rotate: bool = True) -> None:
        if variant == "pipe":
            raise RuntimeError("CUDA_ERROR_INVALID_VALUE")
        out.copy_(want)

    times, wrong = bench.time_variants(ours, out, 7.0, lambda fn: (fn(), 9.0)[1])
    assert wrong == ["pipe (raised RuntimeError: CUDA_ERROR_INVALID_VALUE)"]
    assert set(times) == set(DECODE_VARIANTS) - {"pipe"}
