"""LoRA adapters on a tensor-parallel executor through the real services: a scheduler with
--lora-modules and one executor of two rank processes (--tensor-parallel-size 2 --enable-lora) serve
three PEFT adapters and the base model at once, each request's greedy tokens equal to transformers
with that adapter merged, token for token; each adapter is loaded by the plans into both ranks, each
rank holding its slice (executor_svc/lora/sharding.py); no block is held at the end."""

from __future__ import annotations

import pytest
import torch

from testing.executor_plans import hf_greedy
from testing.lora_adapters import make_adapter, served_greedy
from testing.stack import Stack

pytestmark = pytest.mark.slow

ADAPTERS = {  # name -> (targets, r, alpha)
    "sql": (["q_proj", "v_proj", "down_proj"], 8, 16),
    "chat": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4, 8),
    "poet": (["o_proj", "gate_proj", "up_proj"], 16, 32),
}
PROMPTS = [[5, 17, 99, 3, 250, 31, 7, 41, 8, 12, 300, 2, 77, 19, 45, 6, 90], [40, 41, 42, 43, 44, 45, 46]]
MAX_NEW = 10


def test_a_tensor_parallel_executor_serves_adapters_equal_to_peft_merged(tiny_checkpoint, tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = tiny_checkpoint("llama", "tp")  # 8 q / 4 KV heads: 4 / 2 per rank
    refs = {}
    for i, (name, (targets, r, alpha)) in enumerate(ADAPTERS.items()):
        merged = make_adapter(model_dir, tmp_path / name, targets, r, alpha, seed=40 + i)
        refs[name] = [hf_greedy(merged, p, MAX_NEW) for p in PROMPTS]
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    refs[None] = [hf_greedy(base, p, MAX_NEW) for p in PROMPTS]
    s = Stack(model_dir, tmp_path, ["--enable-lora", "--max-loras", "2", "--lora-modules",
                                    *(f"{n}={tmp_path / n}" for n in ADAPTERS)], secure=False)
    try:
        s.start_scheduler()
        s.start_executor("tp", "--tensor-parallel-size", "2", "--enable-lora", "--max-loras", "2", "--lora-dtype", "float32")
        s.wait_health()
        # three adapters over two slots: a slot is reloaded while serving
        got = served_greedy(s, PROMPTS, [None, *ADAPTERS], MAX_NEW)
        for (name, i), tokens in got.items():
            assert tokens == refs[name][i], (name, i)
        assert len({tuple(refs[n][0]) for n in refs}) == len(refs)  # every adapter changes the output
        (ex,) = s.stats().executors
        assert (ex.tensor_parallel_size, ex.kv_blocks_used) == (2, 0)  # every request done, no block held
    finally:
        s.stop()
