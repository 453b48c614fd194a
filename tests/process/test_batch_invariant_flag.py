"""--batch-invariant through the real services: VLLM_BATCH_INVARIANT=1 turns it on for the
scheduler, which keeps serving with an executor on its C kernels and refuses one on torch
attention, whose process exits with the reason; a seeded request then gives the same logprobs
alone and beside other requests."""

from __future__ import annotations

import threading

import pytest

from pagedserve.v1 import generation_pb2 as pb
from testing.stack import Stack

pytestmark = pytest.mark.slow


def _logprobs(stack: Stack, prompt: str, seed: int) -> list[tuple[int, float]]:
    req = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=12, temperature=0.8, seed=seed,
                                                                      ignore_eos=True, logprobs=2))
    out = []
    for resp in stack.stub.Generate(req, timeout=120):
        for c in resp.choices:
            out += [(lp.token_id, lp.logprob) for lp in c.logprobs]
    return out


def test_the_mode_refuses_a_torch_executor_and_keeps_a_seed_batch_invariant(tiny_llama_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_BATCH_INVARIANT", "1")  # (the stack's processes inherit the environment)
    monkeypatch.delenv("PAGEDSERVE_BATCH_INVARIANT", raising=False)
    with Stack.running(tiny_llama_dir, tmp_path, secure=False) as s:
        monkeypatch.setenv("VLLM_BATCH_INVARIANT", "0")  # this executor does not refuse itself: the scheduler does
        torch_exec = s.start_executor("torch-attention", "--cpu-attention", "torch")
        assert torch_exec.wait(timeout=120) == 2
        log = (tmp_path / "torch-attention.log").read_text()
        assert "the scheduler runs --batch-invariant and this executor's results depend on their batch" in log
        assert "results are not batch-invariant: torch attention" in log
        alone = _logprobs(s, "the quick brown fox", 7)
        others: list = []
        threads = [threading.Thread(target=lambda i=i: others.append(_logprobs(s, "x " * (3 + 5 * i), i)))
                   for i in range(6)]
        for t in threads:
            t.start()
        beside = _logprobs(s, "the quick brown fox", 7)
        for t in threads:
            t.join()
        assert len(alone) == 12 and beside == alone and len(others) == 6
