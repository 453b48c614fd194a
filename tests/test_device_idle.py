"""benchmarks/device_idle.py on the CPU: the measurement make gpu-check runs on a GPU works and adds up."""

from __future__ import annotations

import pytest

from benchmarks.device_idle import _busy_union_us, measure


@pytest.mark.parametrize("prepare_ahead", [False, True])
def test_the_executor_idle_measurement_adds_up(tiny_llama_dir, prepare_ahead):
    r = measure(tiny_llama_dir, "cpu", seqs=8, prompt=32, steps=4, warmup=2, prepare_ahead=prepare_ahead)
    assert r["wall_ms_per_step"] > r["busy_ms_per_step"] > 0 and r["prepare_ahead"] is prepare_ahead
    assert abs(r["wall_ms_per_step"] - r["busy_ms_per_step"] - r["idle_ms_per_step"]) < 0.01
    assert 0 < r["idle_frac"] < 1


def test_busy_time_is_the_union_of_kernel_intervals():
    class E:
        def __init__(self, s, e):
            self.time_range = type("R", (), {"start": s, "end": e})

    assert _busy_union_us([E(0, 10), E(5, 12), E(20, 25), E(21, 22)]) == 17
    assert _busy_union_us([]) == 0
