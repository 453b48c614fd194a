"""The CPU executor's start-up knobs: compute threads (flag, environment, cgroup quota), the
weight-format flags, and the warm-up that runs before registering."""

from __future__ import annotations

import pytest

from executor_svc import threads
from executor_svc.config import parse_config
from executor_svc.model import load_model
from executor_svc.warmup import warm_up

BASE = ["--model", "m", "--scheduler", "tcp://127.0.0.1:5556"]


def _cgroup(root, text: str, v1: bool = False):
    if v1:
        (root / "cpu.cfs_quota_us").write_text(text.split()[0])
        (root / "cpu.cfs_period_us").write_text(text.split()[1])
    else:
        (root / "cpu.max").write_text(text)
    return root


def test_thread_count_precedence(tmp_path, monkeypatch):
    root = _cgroup(tmp_path, "max 100000")
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _: set(range(12)))
    assert threads.resolve_threads(3, {"OMP_NUM_THREADS": "5"}, root) == (3, "--cpu-threads")
    assert threads.resolve_threads(None, {"OMP_NUM_THREADS": "5"}, root) == (5, "OMP_NUM_THREADS")
    n, source = threads.resolve_threads(None, {}, root)
    assert n == 11 and "12" in source  # 12 usable: one left to the socket thread


def test_a_cgroup_quota_caps_the_default(tmp_path, monkeypatch):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _: set(range(64)))
    assert threads.usable_cpus(_cgroup(tmp_path, "250000 100000")) == 3  # 2.5 CPUs: rounded up
    assert threads.default_threads(tmp_path) == 3  # below 8: every CPU computes
    v1 = tmp_path / "v1"
    v1.mkdir()
    assert threads.usable_cpus(_cgroup(v1, "400000 100000", v1=True)) == 4
    assert threads.cgroup_cpu_limit(_cgroup(tmp_path, "max 100000")) is None


def test_the_affinity_mask_caps_the_default(tmp_path, monkeypatch):
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda _: {0, 1})
    assert threads.default_threads(_cgroup(tmp_path, "max 100000")) == 2


def test_cpu_flags_parse_and_name_what_is_wrong(capsys):
    assert parse_config(BASE, {}).cpu_threads is None
    assert parse_config([*BASE, "--cpu-threads", "6"], {}).cpu_threads == 6
    assert parse_config(BASE, {"PAGEDSERVE_CPU_THREADS": "3"}).cpu_threads == 3
    cfg = parse_config([*BASE, "--quantization", "int8", "--dtype", "bfloat16"], {})
    assert cfg.quantization == "int8" and cfg.warmup
    assert not parse_config([*BASE, "--no-warmup"], {}).warmup
    for argv, message in ((["--cpu-threads", "0"], "--cpu-threads: must be >= 1 and <= 4096, got 0"),
                          (["--quantization", "int8", "--device", "cuda"], "--quantization int8: CPU executors"),
                          (["--quantization", "int8", "--dtype", "float16"], "--dtype float16")):
        with pytest.raises(SystemExit):
            parse_config([*BASE, *argv], {})
        assert message in capsys.readouterr().err


def test_warm_up_leaves_no_sequence_and_the_same_outputs(tiny_llama_dir):
    from testing.executor_plans import PlanDriver, make_runner

    model = load_model(tiny_llama_dir)
    prompt = list(range(3, 30))
    cold = PlanDriver(make_runner(tiny_llama_dir, model=model))
    cold.add(1, prompt)
    cold.run_until(8)
    runner = make_runner(tiny_llama_dir, model=model)
    assert warm_up(runner) > 0
    assert runner.seqs == {}
    warm = PlanDriver(runner)
    warm.add(1, prompt)
    warm.run_until(8)
    assert warm.seqs[1].outputs == cold.seqs[1].outputs


def test_warm_up_fits_a_small_cache(tiny_llama_dir):
    from testing.executor_plans import make_runner

    runner = make_runner(tiny_llama_dir, model=load_model(tiny_llama_dir), num_blocks=3)
    warm_up(runner)  # prompts shrink to what three blocks hold
    assert runner.seqs == {}
