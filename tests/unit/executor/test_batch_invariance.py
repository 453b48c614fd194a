"""A request gets the same bits alone and in any mix of requests (issue #43), in both modes.

Seeded random mixes (testing/batch_mixes.py) run through the real Scheduler and the executor's
runner: shared prefixes found in the prefix cache, chunked prefills beside decode tokens, up to 16
requests per step, preemption by recompute and by swap, several decode steps per plan, plans
prepared ahead with two in flight, 1 to 3 compute threads, speculative decoding, and migration of
every request to a second executor. Every sampled token, its log-prob and top log-probs, and every
logits row the sampler was given must equal bit for bit those of the same request served alone.

The executor is built by the executor's own start-up code, with and without ``--batch-invariant``.
On the CPU both modes promise the same (a CPU executor on its C kernels is batch-invariant without
the flag, and says so in its handshake; docs/ARCHITECTURE.md, "What a seed guarantees"), so both
run the same mixes. An executor that cannot promise it (torch attention) is refused under the flag,
and the mixes catch it. A tensor-parallel group of a fixed size keeps the promise too.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from executor_svc.__main__ import build_runner
from executor_svc.attention import TorchAttentionBackend
from executor_svc.batch_invariance import batch_variance
from executor_svc.config import parse_config
from executor_svc.kv_cache import KVCache
from executor_svc.model import load_model
from executor_svc.runner import ModelRunner
from executor_svc.sampler import Sampler
from testing.batch_mixes import (
    BLOCK,
    CPU_BLOCKS,
    PLAIN,
    THEMES,
    MixStats,
    Outputs,
    Setup,
    first_difference,
    random_mix,
    random_requests,
    serve,
)
from testing.tp_harness import tp_runner

TRIALS = (*THEMES, None, None)  # a mix for each feature, and two drawn freely


def _alone(runner: ModelRunner, reqs) -> Outputs:
    """Each request served by itself, the plainest way, on one runner."""
    ref = Outputs({})
    for rid, req in reqs.items():
        one = serve(lambda: runner, {rid: req}, PLAIN)
        ref.samples.update(one.samples)
        ref.rows.update(one.rows)
    return ref


def _factory(model, backend):
    return lambda: ModelRunner(model, KVCache(model.cfg, BLOCK, 256, CPU_BLOCKS, torch.float32), backend, Sampler())


def _mixes(runners, themes, stats: MixStats, seed: str, single_device: bool = True) -> list[str]:
    """Where each trial's mix (one per theme, testing/batch_mixes.py) departed from its requests
    served alone (empty: nowhere)."""
    base, found = runners(), []
    for trial, theme in enumerate(themes):
        setup, reqs = random_mix(random.Random(f"{seed}-{trial}"), base.model.cfg.vocab_size, theme, single_device)
        diff = first_difference(serve(runners, reqs, setup, stats), _alone(base, reqs))
        if diff is not None:
            found.append(f"trial {trial} ({setup}): {diff}")
    return found


def _argv(model_dir, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--scheduler", "tcp://127.0.0.1:1", "--kv-cache-memory", "16MiB",
            "--swap-space", "4MiB", *extra]


@pytest.mark.parametrize("mode", ["default", "--batch-invariant"])
def test_random_mixes_give_every_request_the_bits_it_gets_alone(tiny_llama_dir, mode):
    cfg = parse_config(_argv(tiny_llama_dir, *([mode] if mode != "default" else [])), {})
    assert cfg.batch_invariant == (mode != "default")
    runner, hs = build_runner(cfg)
    assert hs.batch_invariant and hs.numerics.startswith("cpu float32 ")  # promised in either mode
    stats = MixStats()
    assert _mixes(_factory(runner.model, runner.backend), TRIALS, stats, "mix") == []
    # What the mixes exercised, so that the comparison above means what the docstring says.
    assert stats.preemptions > 0 and stats.swapped_blocks > 0, stats
    assert stats.cache_hit_tokens > 0 and stats.migrations > 0 and stats.proposals > 0, stats
    assert stats.mixed_steps > 0 and stats.decode_batches > 0 and stats.multi_step_plans > 0, stats
    assert stats.launched_ahead > 0 and stats.threads == {1, 2, 3}, stats


def test_a_request_among_15_others_in_prefill_and_decode_gets_its_bits_alone(tiny_llama_dir):
    model = load_model(tiny_llama_dir)
    runners = _factory(model, build_runner(parse_config(_argv(tiny_llama_dir), {}))[0].backend)
    reqs = random_requests(random.Random("sixteen"), model.cfg.vocab_size, 16)
    for r in reqs.values():  # long enough that the first are still decoding while the last prefill
        r.params = dataclasses.replace(r.params, max_tokens=16)
    stats = MixStats()
    got = serve(runners, reqs, Setup(budget=128), stats)
    assert stats.most_requests == 16 and stats.mixed_steps > 0, stats
    assert first_difference(got, _alone(runners(), reqs)) is None


def test_an_executor_that_cannot_promise_it_says_why_is_refused_and_the_mixes_catch_it(tiny_llama_dir):
    torch_cfg = parse_config(_argv(tiny_llama_dir, "--cpu-attention", "torch"), {})
    runner, hs = build_runner(torch_cfg)
    assert not hs.batch_invariant and hs.numerics == "cpu float32 torch"
    assert "SDPA blocks its sums by the query count" in batch_variance(runner.model, runner.backend)
    with pytest.raises(ValueError, match="--batch-invariant: this executor's results would depend on their batch"):
        build_runner(parse_config(_argv(tiny_llama_dir, "--cpu-attention", "torch", "--batch-invariant"), {}))
    # The mixes are not blind to what they test: torch's GEMMs and SDPA show through.
    assert isinstance(runner.backend, TorchAttentionBackend)
    assert _mixes(_factory(runner.model, runner.backend), (None, None, None), MixStats(), "mix") != []


def test_the_vllm_variable_turns_the_executors_flag_on(tiny_llama_dir):
    assert parse_config(_argv(tiny_llama_dir), {"VLLM_BATCH_INVARIANT": "1"}).batch_invariant
    assert not parse_config(_argv(tiny_llama_dir), {"VLLM_BATCH_INVARIANT": "0"}).batch_invariant


@pytest.mark.parametrize("world", [2, 4])
def test_a_tensor_parallel_group_of_a_fixed_size_gives_a_request_its_bits_alone(tiny_checkpoint, world):
    """Ranks run packed shards on the C kernels and sum partial products in rank order
    (``TPGroup.all_reduce``); with 4 ranks gloo's ring would have ordered each sum by the buffer's size."""
    with tp_runner(tiny_checkpoint("llama", "tp"), world=world, num_blocks=256, num_cpu_blocks=CPU_BLOCKS) as leader:
        assert batch_variance(leader.model, leader.backend) is None
        stats = MixStats()
        assert _mixes(lambda: leader, ("swap", "recompute", None), stats, f"tp{world}", single_device=False) == []
        assert stats.mixed_steps > 0 and stats.decode_batches > 0, stats
