"""``make gpu-check``'s tensor-parallel case, on the CPU: the skip rule, and the check itself
run with gloo instead of NCCL (the same code path, the CPU attention backend)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from testing.kernels.tp_check import run_tp_check, skip_reason


def test_one_gpu_skips_the_nccl_case_with_a_message():
    assert skip_reason("cuda", 2, 1) == ("tensor-parallel check (N = 2, NCCL) skipped: it needs 2 GPUs, "
                                         "this machine has 1")
    assert skip_reason("cuda", 2, 2) is None and skip_reason("cpu", 2, 0) is None
    assert run_tp_check(60, device_count=1) == {"skipped": skip_reason("cuda", 2, 1), "returncode": 0}


@pytest.mark.slow
def test_the_check_passes_on_two_cpu_ranks(tiny_checkpoint):
    out = subprocess.run([sys.executable, "-m", "testing.kernels.tp_check", "--device", "cpu", "--model",
                          str(tiny_checkpoint("llama", "tp"))], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.count("PASS ours") == 3 and "tensor-parallel N = 2 on cpu (rank 0: 4 q / 2 KV heads): PASS" \
        in out.stdout
