"""Many LoRA adapters in one step (executor_svc/lora): tokens of 4 adapters and the base model
packed in one forward give each sequence its logits alone, equal to PEFT's merged model; decode
steps with adapter tokens keep the fused C decode stack, which adds the deltas itself; slots load,
replace and unload cleanly."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_svc.lora import LoraError, LoraManager
from executor_svc.model import load_model
from testing.executor_plans import hf_logits
from testing.lora_adapters import forced_logits, make_adapter, torch_model

ADAPTERS = [  # slot -> (targets, r, alpha, rsLoRA, bf16 file)
    (["q_proj", "v_proj"], 8, 16, False, False),
    (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4, 8, True, False),
    (["gate_proj", "up_proj", "down_proj"], 16, 16, False, True),
    (["k_proj", "o_proj"], 2, 8, False, False),
]
SLOTS = [2, -1, 0, 3, 1]  # sequence i runs on slot SLOTS[i] (-1: the base model)


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(1, 500, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [_prompt(n, i) for i, n in enumerate([5, 13, 1, 21, 9])]
CONTS = [_prompt(4, 100 + i) for i in range(5)]


@pytest.fixture(scope="module")
def refs(tiny_llama_dir, tmp_path_factory):
    """(adapter dirs by slot, transformers' logits per sequence [1 + steps, vocab])."""
    dirs, merged = [], []
    for slot, (targets, r, alpha, rs, bf16) in enumerate(ADAPTERS):
        d = tmp_path_factory.mktemp(f"lora-slot{slot}")
        merged.append(make_adapter(tiny_llama_dir, d, targets, r, alpha, rs, bf16, seed=10 + slot))
        dirs.append(d)
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    logits = []
    for slot, p, c in zip(SLOTS, PROMPTS, CONTS, strict=True):
        hf = base if slot < 0 else merged[slot]
        logits.append(hf_logits(hf, p + c)[len(p) - 1:])
    return dirs, logits


@pytest.fixture(scope="module", params=["packed_c", "torch"])
def served(request, tiny_llama_dir, refs):
    model, attention = (load_model(tiny_llama_dir), "fused") if request.param == "packed_c" else \
        (torch_model(tiny_llama_dir), "torch")
    manager = LoraManager(model, max_loras=4, max_rank=16)
    for slot, d in enumerate(refs[0]):
        manager.load(slot, str(d))
    return model, manager, attention


def test_mixed_batch_equals_each_alone_and_peft(served, refs):
    model, manager, attention = served
    mixed = forced_logits(model, manager, attention, SLOTS, PROMPTS, CONTS)
    for i, (slot, p, c) in enumerate(zip(SLOTS, PROMPTS, CONTS, strict=True)):
        alone = forced_logits(model, manager, attention, [slot], [p], [c])[0]
        # (rounding only: the deltas' torch products, and the torch model's, round by their row count)
        torch.testing.assert_close(mixed[i], alone, rtol=1e-5, atol=5e-5, msg=f"sequence {i}, slot {slot}")
        torch.testing.assert_close(mixed[i], refs[1][i], rtol=1e-5, atol=1e-4, msg=f"sequence {i}, slot {slot}")
        assert torch.equal(mixed[i].argmax(-1), refs[1][i].argmax(-1))


def test_each_adapter_changes_its_sequence(served, refs):
    """The check above would catch an ignored adapter: each one's logits are far from the base model's."""
    model, manager, attention = served
    base = forced_logits(model, manager, attention, [-1] * 5, PROMPTS, CONTS)
    for i, slot in enumerate(SLOTS):
        gap = float((base[i] - refs[1][i]).abs().max())
        assert gap < 1e-4 if slot < 0 else gap > 0.1, (i, slot, gap)


def test_adapter_decode_steps_take_the_fused_decode_stack_and_equal_the_modules(tiny_llama_dir, refs):
    """A decode step with adapter tokens stays one C call (its deltas in csrc/lora_cpu.c); its logits
    are the modules' path's (torch deltas) up to rounding, and PEFT's (the mixed test above)."""
    model = load_model(tiny_llama_dir)
    stack, calls = model.decode_stack, []
    assert stack is not None

    def spy(*args):
        calls.append(args[4] is not None)
        return stack(*args)
    model.decode_stack = spy
    manager = LoraManager(model, max_loras=4, max_rank=16)
    for slot, d in enumerate(refs[0]):
        manager.load(slot, str(d))
    fused = forced_logits(model, manager, "fused", SLOTS, PROMPTS, CONTS)
    assert calls == [True] * len(CONTS[0])  # every decode step, with its adapters
    calls.clear()
    model.decode_stack = None
    modules = forced_logits(model, manager, "fused", SLOTS, PROMPTS, CONTS)
    torch.testing.assert_close(fused, modules, rtol=1e-5, atol=5e-5)
    for i in range(len(SLOTS)):
        assert torch.equal(fused[i].argmax(-1), refs[1][i].argmax(-1))


def test_bfloat16_slots_hold_a_bfloat16_adapter_exactly(tiny_llama_dir, refs):
    """bfloat16 slots (--lora-dtype bfloat16): an adapter stored in bfloat16 with scaling 1 loses
    nothing, so its logits are PEFT's; the decode steps (C kernel) and the modules' torch products
    read the same rounded weights."""
    model = load_model(tiny_llama_dir)
    stack = model.decode_stack
    manager = LoraManager(model, max_loras=2, max_rank=16, dtype=torch.bfloat16)
    assert manager.slots.layers[0]["gate_up_proj"].a.dtype == torch.bfloat16
    manager.load(1, str(refs[0][2]))  # ADAPTERS[2]: bfloat16 file, alpha / r = 1
    i = SLOTS.index(2)
    fused = forced_logits(model, manager, "fused", [1], [PROMPTS[i]], [CONTS[i]])[0]
    torch.testing.assert_close(fused, refs[1][i], rtol=1e-5, atol=1e-4)
    model.decode_stack = None
    modules = forced_logits(model, manager, "fused", [1], [PROMPTS[i]], [CONTS[i]])[0]
    model.decode_stack = stack
    torch.testing.assert_close(fused, modules, rtol=1e-5, atol=5e-5)


def test_load_replace_unload_and_failed_load_changes_nothing(tiny_llama_dir, refs, tmp_path):
    model = load_model(tiny_llama_dir)
    manager = LoraManager(model, max_loras=2, max_rank=16)
    a, b = str(refs[0][0]), str(refs[0][2])  # slot 0's adapter (q, v) and slot 2's (MLP)
    manager.load(1, a)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text('{"r": 8, "lora_alpha": 16, "use_dora": true}')
    with pytest.raises(LoraError, match="DoRA"):
        manager.load(1, str(bad))
    with pytest.raises(LoraError, match="DoRA"):
        manager.load(0, str(bad))
    assert manager.loaded() == {1: a}
    def one(slot: int, seq: int) -> torch.Tensor:  # sequence ``seq``'s prompt on ``slot``
        return forced_logits(model, manager, "fused", [slot], [PROMPTS[seq]], [CONTS[seq]])[0]
    torch.testing.assert_close(one(1, 2), refs[1][2], rtol=1e-5, atol=1e-4)  # (sequence 2 runs slot 0's adapter)
    manager.load(1, b)  # replaces: nothing of the first adapter stays
    assert manager.loaded() == {1: b}
    torch.testing.assert_close(one(1, 0), refs[1][0], rtol=1e-5, atol=1e-4)  # (sequence 0 runs slot 2's)
    manager.unload(1)
    assert manager.loaded() == {}
    torch.testing.assert_close(one(-1, 1), refs[1][1], rtol=1e-5, atol=1e-4)  # (sequence 1: the base model)
    assert all(p.used[1] == 0 and not p.a[1].any() and not p.bt[1].any()
               for layer in manager.slots.layers for p in layer.values())
