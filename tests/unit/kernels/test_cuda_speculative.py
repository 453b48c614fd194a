"""Speculative verification on the CUDA path: the real Scheduler's plans with proposals, run by a runner
on the CuPy attention backend, whose verification chunks (a sequence's last token and its k
proposals) go through the paged prefill kernel over the sequence's cached blocks. Run on the CPU with
every kernel executed from its source by the SIMT emulator (CI) and on a GPU with the real launchers
(marked ``gpu``; ``make gpu-check``).

Greedy outputs must equal the same runner's without speculation, with the fused layers and without,
with whole acceptances, bonus tokens and rejections midway; every block must be free at the end."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine_api import RequestParams
from pagedserve.wire import SamplingParams
from scheduler_svc.sched.speculation import SpeculativeConfig
from testing.kernels.cuda_site import cuda_model, cupy_runner
from testing.speculative_serving import OracleProposer, serve

K = 4
PROMPTS = {"a": [(7 * i + 3) % 400 + 1 for i in range(13)], "b": [(11 * i + 5) % 400 + 1 for i in range(21)]}
PARAMS = RequestParams(max_tokens=12, sampling=SamplingParams(temperature=0.0), ignore_eos=True)


@pytest.mark.parametrize("fused", [False, True], ids=["modules", "fused_layers"])
def test_verification_through_the_prefill_kernel_keeps_greedy_outputs(where, tiny_llama_dir, monkeypatch, fused):
    calls = where.patch(monkeypatch)
    model = cuda_model(tiny_llama_dir, where, torch.float32, fused=fused)[0]
    plain = serve(cupy_runner(model), PARAMS, None, PROMPTS)
    decode_only = calls["prefill"]  # (the prompts' prefills)
    spec = serve(cupy_runner(model), PARAMS, SpeculativeConfig(num_speculative_tokens=K), PROMPTS,
                 proposer=OracleProposer(PROMPTS, plain.outputs, K))
    assert spec.outputs == plain.outputs
    st = spec.sched.spec.counters
    assert st.num_accepted_tokens > st.num_drafts  # runs of proposals accepted, with the bonus token
    assert st.num_accepted_tokens < st.num_draft_tokens  # and cut at a wrong one
    assert len(spec.plans) < len(plain.plans)
    assert calls["prefill"] - decode_only > len(PROMPTS)  # the verifications ran as chunks of k + 1 queries
