"""LoRA adapters (executor_svc/lora) against PEFT: logits equal to transformers with the adapter
merged (``merge_and_unload``), for the plain torch model and the CPU-packed one (C kernels and
torch), and every refused adapter refused with a message naming its problem."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from executor_svc.lora import LoraError, LoraManager, load_adapter
from executor_svc.model import load_model
from testing.executor_plans import hf_logits
from testing.lora_adapters import forced_logits, make_adapter, torch_model

PROMPT = [17, 301, 45, 9, 250, 77, 133, 402, 8, 61, 199, 5]
CONT = [88, 310, 2, 141]

# (targets, r, alpha, rsLoRA, stored in bfloat16)
CASES = {
    "q_v": (["q_proj", "v_proj"], 8, 16, False, False),
    "all_rslora": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4, 8, True, False),
    "o_mlp_bf16": (["o_proj", "gate_proj", "down_proj"], 16, 32, False, True),
    "k_up_rslora_bf16": (["k_proj", "up_proj"], 2, 4, True, True),
}
MODELS = {  # how our model is built, and the CPU attention it runs with
    "torch": (torch_model, "torch"),
    "packed_c": (load_model, "fused"),
    "packed_torch": (lambda p: load_model(p, cpu_kernels=False), "fused"),
}


@pytest.fixture(scope="module")
def adapters(tiny_llama_dir, tmp_path_factory):
    """case -> (adapter dir, transformers' logits of PROMPT + CONT with it merged)."""
    out = {}
    for i, (name, (targets, r, alpha, rs, bf16)) in enumerate(CASES.items()):
        d = tmp_path_factory.mktemp(f"lora-{name}")
        merged = make_adapter(tiny_llama_dir, d, targets, r, alpha, rs, bf16, seed=i)
        out[name] = d, hf_logits(merged, PROMPT + CONT)[len(PROMPT) - 1:]
    return out


@pytest.fixture(scope="module")
def base_logits(tiny_llama_dir):
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    return hf_logits(hf, PROMPT + CONT)[len(PROMPT) - 1:]


@pytest.fixture(scope="module", params=list(MODELS))
def served(request, tiny_llama_dir):
    build, attention = MODELS[request.param]
    model = build(tiny_llama_dir)
    return model, LoraManager(model, max_loras=4, max_rank=16), attention


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_peft_merged(served, adapters, base_logits, case):
    model, manager, attention = served
    path, ref = adapters[case]
    manager.load(1, str(path))
    ours = forced_logits(model, manager, attention, [1], [PROMPT], [CONT])[0]
    assert (ref - base_logits).abs().max() > 0.1  # the adapter matters: ignoring it would fail below
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-4)
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert manager.loaded() == {1: str(path)}


def test_qwen2_bias_and_tied_head(tiny_qwen2_dir, tmp_path):
    merged = make_adapter(tiny_qwen2_dir, tmp_path, ["q_proj", "k_proj", "down_proj"], r=4, alpha=8)
    ref = hf_logits(merged, PROMPT + CONT)[len(PROMPT) - 1:]
    model = load_model(tiny_qwen2_dir)
    manager = LoraManager(model, max_loras=2, max_rank=8)
    manager.load(0, str(tmp_path))
    ours = forced_logits(model, manager, "fused", [0], [PROMPT], [CONT])[0]
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-4)


def test_scaling_and_rank(adapters, tiny_llama_dir):
    from executor_svc.model import load_model_config

    cfg = load_model_config(tiny_llama_dir)
    plain, rs = load_adapter(adapters["q_v"][0], cfg, 16), load_adapter(adapters["all_rslora"][0], cfg, 16)
    assert (plain.rank, plain.scaling) == (8, 2.0) and plain.modules == {"q_proj", "v_proj"}
    assert (rs.rank, rs.scaling) == (4, 4.0)  # 8 / sqrt(4)
    assert all(a.dtype == b.dtype == torch.float32 for a, b in load_adapter(
        adapters["o_mlp_bf16"][0], cfg, 16).weights.values())


# ---------------------------------------------------------------- refusals

@pytest.fixture(scope="module")
def good(adapters):
    return adapters["q_v"][0]


@pytest.fixture(scope="module")
def model_manager(tiny_llama_dir):
    model = load_model(tiny_llama_dir)
    return model, LoraManager(model, max_loras=2, max_rank=8)


def _edited(good, tmp_path, **config):
    d = tmp_path / "edited"
    shutil.copytree(good, d)
    raw = json.loads((d / "adapter_config.json").read_text())
    raw.update(config)
    (d / "adapter_config.json").write_text(json.dumps(raw))
    return d


def _refused(manager, path, *words):
    with pytest.raises(LoraError) as err:
        manager.load(0, str(path))
    for w in words:
        assert w in str(err.value), (w, str(err.value))


@pytest.mark.parametrize("config, words", [
    ({"bias": "all"}, ["bias='all'"]),
    ({"bias": "lora_only"}, ["bias='lora_only'"]),
    ({"use_dora": True}, ["DoRA"]),
    ({"modules_to_save": ["lm_head"]}, ["modules_to_save"]),
    ({"rank_pattern": {"q_proj": 4}}, ["rank_pattern"]),
    ({"alpha_pattern": {"q_proj": 4}}, ["alpha_pattern"]),
    ({"r": 16}, ["r=16", "exceeds max_rank 8"]),  # (the tensors' rank is 8: r is checked first)
    ({"r": 0}, ["r must be a positive integer"]),
    ({"lora_alpha": "x"}, ["lora_alpha"]),
    ({"target_modules": ["q_proj", "dense"]}, ["target module", "dense", "not in the base model"]),
    ({"peft_type": "IA3"}, ["peft_type 'IA3'"]),
])
def test_unsupported_configs(model_manager, good, tmp_path, config, words):
    _refused(model_manager[1], _edited(good, tmp_path, **config), *words)


def test_missing_and_corrupt_files(model_manager, good, tmp_path):
    manager = model_manager[1]
    _refused(manager, tmp_path / "nowhere", "not a directory")
    d = tmp_path / "d"
    shutil.copytree(good, d)
    (d / "adapter_config.json").write_text("{not json")
    _refused(manager, d, "adapter_config.json", "not valid JSON")
    (d / "adapter_config.json").unlink()
    _refused(manager, d, "adapter_config.json not found")
    shutil.copy(good / "adapter_config.json", d)
    (d / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00garbage")
    _refused(manager, d, "adapter_model.safetensors", "corrupt")
    (d / "adapter_model.safetensors").unlink()
    _refused(manager, d, "adapter_model.safetensors not found")
    (d / "adapter_model.bin").write_bytes(b"pickle")
    _refused(manager, d, "adapter_model.safetensors not found", "pickle")


def _rewrite_tensors(good, tmp_path, edit):
    from safetensors.torch import load_file, save_file

    d = tmp_path / "t"
    shutil.copytree(good, d)
    tensors = load_file(d / "adapter_model.safetensors")
    save_file(edit(tensors), d / "adapter_model.safetensors")
    return d


def test_tensor_problems(model_manager, good, tmp_path):
    manager = model_manager[1]
    key = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"

    def drop_b(t):
        t.pop(key.replace("lora_A", "lora_B"))
        return t
    _refused(manager, _rewrite_tensors(good, tmp_path / "1", drop_b), "layer 1 q_proj", "without its pair")

    def rename(t):
        t[key.replace("q_proj", "qk_proj")] = t.pop(key)
        return t
    _refused(manager, _rewrite_tensors(good, tmp_path / "2", rename), "target module self_attn.qk_proj",
             "not in the base model")

    def embed(t):
        t["base_model.model.lm_head.weight"] = torch.zeros(4, 4)
        return t
    _refused(manager, _rewrite_tensors(good, tmp_path / "3", embed), "unsupported tensor", "lm_head")

    def far_layer(t):
        t[key.replace("layers.1", "layers.9")] = t.pop(key)
        t[key.replace("layers.1", "layers.9").replace("lora_A", "lora_B")] = t.pop(key.replace("lora_A", "lora_B"))
        return t
    _refused(manager, _rewrite_tensors(good, tmp_path / "4", far_layer), "layer 9", "2 layers")

    def ints(t):
        t[key] = t[key].to(torch.int32)
        return t
    _refused(manager, _rewrite_tensors(good, tmp_path / "5", ints), "dtype torch.int32")


def test_shapes_of_another_base_are_refused(model_manager, tiny_checkpoint, tmp_path):
    other = tiny_checkpoint("llama", "tp")  # hidden 128, not 64
    make_adapter(other, tmp_path, ["q_proj"], r=4, alpha=8)
    _refused(model_manager[1], tmp_path, "q_proj", "disagree with the base model")


def test_manager_arguments_and_slots(tiny_llama_dir, model_manager, good):
    model, manager = model_manager
    with pytest.raises(LoraError, match="max_rank must be an integer in \\[1, 256\\]"):
        LoraManager(torch_model(tiny_llama_dir), max_loras=2, max_rank=512)
    with pytest.raises(LoraError, match="max_loras must be a positive integer"):
        LoraManager(torch_model(tiny_llama_dir), max_loras=0, max_rank=8)
    with pytest.raises(LoraError, match="already has a LoraManager"):
        LoraManager(model, max_loras=2, max_rank=8)
    with pytest.raises(LoraError, match="slot 2 out of range: slots are 0..1"):
        manager.load(2, str(good))
    with pytest.raises(LoraError, match="slot -1 out of range"):
        manager.unload(-1)
    manager.unload(1)
    with pytest.raises(LoraError, match="slot\\(s\\) \\[1\\] that hold no adapter"):
        with manager.batch([1, -1, 1]):
            pass


def test_tensor_parallel_rank_needs_its_shard(tiny_llama_dir):
    """A rank's slots are its slice of each layer: a manager that does not know which is refused
    (adapters would be checked against the wrong shapes); tests/unit/executor/test_tp_lora.py serves them."""
    from executor_svc.parallel.shard import TPShard

    model = torch_model(tiny_llama_dir)
    model.reduce = lambda t: t  # what a tensor-parallel rank's model holds
    with pytest.raises(LoraError, match="tensor-parallel rank's: give LoraManager its shard"):
        LoraManager(model, max_loras=2, max_rank=8)
    with pytest.raises(LoraError, match="needs the whole model's config \\(base_cfg\\)"):
        LoraManager(model, max_loras=2, max_rank=8, shard=TPShard(0, 2))
