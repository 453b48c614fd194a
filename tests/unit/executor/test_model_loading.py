"""config.json parsing, refusals, safetensors loading (sharded), fingerprints, the tiny checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from executor_svc.config import parse_config
from executor_svc.model import UnsupportedModelError, load_model, model_fingerprint, parse_model_config
from executor_svc.model.loader import weight_files
from testing.executor_plans import PlanDriver, make_runner

BASE = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
        "max_position_embeddings": 2048}


def test_old_style_rope_fields_are_read():
    cfg = parse_model_config({**BASE, "rope_theta": 500000.0,
                              "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert (cfg.rope.theta, cfg.rope.rope_type, cfg.rope.factor) == (500000.0, "linear", 2.0)
    cfg = parse_model_config({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}})
    assert (cfg.rope.theta, cfg.rope.rope_type) == (1e6, "default")
    assert cfg.head_dim == 16 and not cfg.qkv_bias


def test_qwen2_has_qkv_bias_and_mistral_window_caps_length():
    qwen = parse_model_config({**BASE, "architectures": ["Qwen2ForCausalLM"]})
    assert qwen.qkv_bias and not qwen.o_bias
    mistral = parse_model_config({**BASE, "architectures": ["MistralForCausalLM"], "sliding_window": 512})
    assert mistral.max_position_embeddings == 512


@pytest.mark.parametrize("change, words", [
    ({"architectures": ["GPT2LMHeadModel"]}, ["GPT2LMHeadModel", "LlamaForCausalLM", "Qwen2ForCausalLM"]),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, ["yarn", "llama3", "linear"]),
    ({"hidden_act": "gelu"}, ["hidden_act", "silu"]),
    ({"num_key_value_heads": 3}, ["num_key_value_heads"]),
    ({"hidden_size": None}, ["hidden_size"]),
])
def test_unsupported_configs_are_refused_naming_what(change, words):
    with pytest.raises(UnsupportedModelError) as err:
        parse_model_config({**BASE, **change})
    for w in words:
        assert w in str(err.value)


def test_sharded_checkpoint_loads_identically(tiny_checkpoint, tiny_llama_dir):
    sharded = tiny_checkpoint("llama", "small", max_shard_size="100KB")
    assert len(weight_files(sharded)) > 1 and (sharded / "model.safetensors.index.json").exists()
    a, b = load_model(tiny_llama_dir), load_model(sharded)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert na == nb and torch.equal(pa, pb)


def test_missing_weights_and_no_weights_are_errors(tiny_llama_dir, tmp_path):
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(tmp_path)
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg["num_hidden_layers"] += 1  # the checkpoint lacks the extra layer
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shutil.copy(tiny_llama_dir / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(UnsupportedModelError, match="lacks"):
        load_model(tmp_path)


def test_fingerprint_tracks_config_and_weight_layout(tiny_llama_dir, tiny_qwen2_dir, tiny_checkpoint, tmp_path):
    fp = model_fingerprint(tiny_llama_dir)
    assert fp == model_fingerprint(tiny_llama_dir) and len(fp) == 64
    assert fp != model_fingerprint(tiny_qwen2_dir)
    # Sharding changes files, not the model (same config, names, shapes, dtypes).
    assert fp == model_fingerprint(tiny_checkpoint("llama", "small", max_shard_size="100KB"))
    shutil.copy(tiny_llama_dir / "model.safetensors", tmp_path / "model.safetensors")
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert fp != model_fingerprint(tmp_path)


def test_tiny_checkpoint_is_a_real_hf_directory(tiny_llama_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    assert len(tok) == cfg["vocab_size"] and tok.eos_token_id == cfg["eos_token_id"]
    ids = tok("The quick server stores every block.")["input_ids"]
    assert tok.decode(ids) == "The quick server stores every block."
    assert all(isinstance(tok.decode([i]), str) for i in range(cfg["vocab_size"]))


@pytest.mark.parametrize("arch, size", [("llama", "small"), ("qwen2", "small"), ("mistral", "small"),
                                        ("llama", "default")])
def test_tiny_models_greedy_output_is_not_degenerate(tiny_checkpoint, arch, size):
    path = tiny_checkpoint(arch, size)
    drv = PlanDriver(make_runner(path))
    for i, prompt in enumerate(([5, 9, 30, 41], [100, 7], [3])):
        drv.add(i, prompt)
    drv.run_until(48)
    for i in range(3):
        tail = drv.seqs[i].outputs[16:]
        assert len(set(tail)) >= 4, (arch, i, drv.seqs[i].outputs)


def test_executor_flags_and_environment(tmp_path):
    env = {"PAGEDSERVE_KV_CACHE_MEMORY": "512MiB", "PAGEDSERVE_BLOCK_SIZE": "32", "PAGEDSERVE_DTYPE": "bfloat16"}
    cfg = parse_config(["--model", str(tmp_path), "--scheduler", "tcp://h:5556", "--block-size", "8"], env)
    assert cfg.kv_cache_memory == 512 * 2**20 and cfg.block_size == 8 and cfg.dtype == "bfloat16"
    assert cfg.swap_space == 4 * 2**30 and cfg.health_port == 8090 and cfg.executor_id
    with pytest.raises(SystemExit):
        parse_config(["--model", "m", "--scheduler", "tcp://h:1", "--gpu-memory-utilization", "1.5"], {})
    with pytest.raises(SystemExit):
        parse_config(["--model", "m", "--scheduler", "h:1"], {})
