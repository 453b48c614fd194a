"""How many threads a fused CPU decode step uses (executor_svc/step_threads.py): the choice follows
the measured step times, and every count computes the same numbers."""

from __future__ import annotations

import pytest
import torch

from executor_svc.model import load_model
from executor_svc.step_threads import FIRST_TRIAL_AFTER, SAMPLES, TRIAL_EVERY, StepThreads
from testing.cpu_agreement import Forcer


def _run(chooser: StepThreads, steps: int, seconds_of, n: int = 1, most: int = 2) -> list[int]:
    """``steps`` decode steps of ``n`` sequences; ``seconds_of(threads, step)`` is each one's time."""
    used = []
    for k in range(steps):
        t = chooser.pick(n, most)
        used.append(t)
        chooser.record(n, most, t, seconds_of(t, k))
    return used


def test_one_thread_fewer_is_kept_when_it_is_faster():
    chooser = StepThreads()
    used = _run(chooser, FIRST_TRIAL_AFTER + 2 * SAMPLES + 100, lambda t, _: {2: 4.7e-3, 1: 3.9e-3}[t])
    assert used[:FIRST_TRIAL_AFTER] == [2] * FIRST_TRIAL_AFTER  # all threads until the first trial
    trial = used[FIRST_TRIAL_AFTER:FIRST_TRIAL_AFTER + 2 * SAMPLES]
    assert trial == [1] * SAMPLES + [2] * SAMPLES  # the other count, then the one in use, back to back
    assert set(used[FIRST_TRIAL_AFTER + 2 * SAMPLES:]) == {1}
    assert chooser.choices() == {0: 1}


def test_all_threads_stay_when_they_are_faster_and_trials_grow_rare():
    chooser = StepThreads()
    steps = FIRST_TRIAL_AFTER + 2 * TRIAL_EVERY + 4 * TRIAL_EVERY + 6 * SAMPLES
    used = _run(chooser, steps, lambda t, _: {2: 6.6e-3, 1: 8.7e-3}[t])
    assert chooser.choices() == {0: 2}
    fewer = [k for k, t in enumerate(used) if t == 1]
    assert len(fewer) == 3 * SAMPLES  # three trials of SAMPLES steps each, no more
    starts = [k for k in fewer if k - 1 not in fewer]
    assert starts[1] - starts[0] == 2 * SAMPLES + 2 * TRIAL_EVERY  # the choice held: the next gap doubles
    assert starts[2] - starts[1] == 2 * SAMPLES + 4 * TRIAL_EVERY


def test_a_change_of_conditions_is_followed_at_the_next_trial():
    chooser = StepThreads()
    switch = FIRST_TRIAL_AFTER + 2 * SAMPLES + 10  # after the first trial kept all threads
    used = _run(chooser, switch + 2 * TRIAL_EVERY + 2 * SAMPLES + 50,
                lambda t, k: {2: 5e-3, 1: 6e-3}[t] if k < switch else {2: 5e-3, 1: 4e-3}[t])
    assert used[switch] == 2 and used[-1] == 1


def test_steps_without_a_time_end_their_trial_and_change_nothing():
    chooser = StepThreads()
    used = _run(chooser, FIRST_TRIAL_AFTER + 2 * SAMPLES + 20, lambda t, _: None)  # e.g. every period held a prefill
    assert used[FIRST_TRIAL_AFTER:FIRST_TRIAL_AFTER + SAMPLES] == [1] * SAMPLES
    assert set(used[FIRST_TRIAL_AFTER + SAMPLES:]) == {2} and chooser.choices() == {0: 2}


def test_size_classes_are_timed_apart_and_large_steps_use_every_thread():
    chooser = StepThreads()
    _run(chooser, 200, lambda t, _: {2: 5e-3, 1: 4e-3}[t], n=1)
    _run(chooser, 200, lambda t, _: {2: 5e-3, 1: 9e-3}[t], n=12)
    assert chooser.choices() == {StepThreads.size_class(1): 1, StepThreads.size_class(12): 2}
    assert chooser.pick(65, 2) == 2 and chooser.pick(1, 1) == 1
    chooser.enabled = False
    assert chooser.pick(1, 2) == 2


@pytest.mark.parametrize("fmt,kwargs,kv_dtype", [("float32", {}, torch.float32),
                                                 ("bfloat16", {"dtype": torch.bfloat16}, torch.bfloat16),
                                                 ("int8", {"quantization": "int8"}, torch.float32)])
def test_every_thread_count_computes_the_same_logits(tiny_checkpoint, fmt, kwargs, kv_dtype):
    model = load_model(tiny_checkpoint("llama", "small"), **kwargs)
    stack = model.decode_stack
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, model.cfg.vocab_size, (9 + 5 * i,), generator=g).tolist() for i in range(5)]
    before = torch.get_num_threads()
    results = {}
    try:
        torch.set_num_threads(3)
        for threads in (3, 2, 1):
            stack.threads.pick = lambda n, most, t=threads: t  # this count for every step
            forcer = Forcer(model, kv_dtype, len(prompts), 48)
            tokens = torch.cat([forcer.step([i], [p]) for i, p in enumerate(prompts)]).argmax(-1)
            steps = []
            for _ in range(4):
                logits = forcer.step(list(range(len(prompts))), [[int(t)] for t in tokens])
                steps.append(logits)
                tokens = logits.argmax(-1)
            results[threads] = torch.stack(steps)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[3], results[1]) and torch.equal(results[2], results[1])


def test_only_the_executor_turns_the_choice_on_by_its_flag(tiny_llama_dir):
    from executor_svc.__main__ import build_runner
    from executor_svc.config import parse_config

    assert not load_model(tiny_llama_dir).decode_stack.threads.enabled  # benchmarks and tests: all threads
    for flag, enabled in (([], True), (["--cpu-decode-threads", "all"], False)):
        cfg = parse_config(["--model", str(tiny_llama_dir), "--scheduler", "tcp://127.0.0.1:5556", "--device", "cpu",
                            "--kv-cache-memory", "16MiB", "--swap-space", "0", *flag])
        runner, _ = build_runner(cfg)
        assert runner.model.decode_stack.threads.enabled is enabled
