"""Load an HF checkpoint directory (safetensors, sharded or not) into our model.

Weights are read tensor by tensor with ``safetensors`` (never pickle) and
copied into parameters allocated once on the target device, so peak memory is
the model plus one tensor. HF's separate q/k/v and gate/up weights are copied
into slices of our fused projections.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from executor_svc.model.config import ModelConfig, UnsupportedModelError, load_model_config
from executor_svc.model.llama import LlamaForCausalLM
from executor_svc.model.rope import RotaryEmbedding
from pagedserve.wire.fingerprint import weight_files

log = logging.getLogger(__name__)

_PROGRESS_MIN_BYTES = 512 * 1024 * 1024  # show a progress bar only for checkpoints this large
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _targets(cfg: ModelConfig) -> dict[str, tuple[str, int, int]]:
    """HF tensor name -> (our parameter name, first row, row count) for every tensor we need."""
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    t: dict[str, tuple[str, int, int]] = {
        "model.embed_tokens.weight": ("embed_tokens.weight", 0, cfg.vocab_size),
        "model.norm.weight": ("norm.weight", 0, cfg.hidden_size),
    }
    if not cfg.tie_word_embeddings:
        t["lm_head.weight"] = ("lm_head.weight", 0, cfg.vocab_size)
    for i in range(cfg.num_layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        kinds = ["weight"] + (["bias"] if cfg.qkv_bias else [])
        for kind in kinds:
            for proj, start, rows in (("q_proj", 0, q), ("k_proj", q, kv), ("v_proj", q + kv, kv)):
                t[f"{hf}self_attn.{proj}.{kind}"] = (f"{ours}self_attn.qkv_proj.{kind}", start, rows)
        t[f"{hf}self_attn.o_proj.weight"] = (f"{ours}self_attn.o_proj.weight", 0, cfg.hidden_size)
        if cfg.o_bias:
            t[f"{hf}self_attn.o_proj.bias"] = (f"{ours}self_attn.o_proj.bias", 0, cfg.hidden_size)
        t[f"{hf}mlp.gate_proj.weight"] = (f"{ours}mlp.gate_up_proj.weight", 0, inter)
        t[f"{hf}mlp.up_proj.weight"] = (f"{ours}mlp.gate_up_proj.weight", inter, inter)
        t[f"{hf}mlp.down_proj.weight"] = (f"{ours}mlp.down_proj.weight", 0, cfg.hidden_size)
        t[f"{hf}input_layernorm.weight"] = (f"{ours}input_layernorm.weight", 0, cfg.hidden_size)
        t[f"{hf}post_attention_layernorm.weight"] = (f"{ours}post_attention_layernorm.weight", 0, cfg.hidden_size)
    return t


def load_model(model_dir: str | Path, device: str | torch.device = "cpu",
               dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    cfg = load_model_config(model_dir)
    model = LlamaForCausalLM(cfg).to_empty(device=device).to(dtype)
    params = dict(model.named_parameters())
    targets = _targets(cfg)
    files = weight_files(model_dir)
    total = sum(f.stat().st_size for f in files)
    seen: set[str] = set()
    with tqdm(total=total, unit="B", unit_scale=True, desc="loading weights",
              disable=total < _PROGRESS_MIN_BYTES) as bar:
        for path in files:
            with safe_open(str(path), framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_tensor(name)
                    bar.update(tensor.numel() * tensor.element_size())
                    if name in targets:
                        _copy_into(params, targets[name], name, tensor)
                        seen.add(name)
                    elif not name.endswith(_IGNORED_SUFFIXES) and not (
                            cfg.tie_word_embeddings and name == "lm_head.weight"):
                        log.warning("ignoring unexpected weight %s", name)
    missing = sorted(set(targets) - seen)
    if missing:
        raise UnsupportedModelError(f"{model_dir}: checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")
    model.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, torch.device(device))
    return model.eval()


def _copy_into(params: dict[str, torch.nn.Parameter], target: tuple[str, int, int], name: str,
               tensor: torch.Tensor) -> None:
    param_name, start, rows = target
    dst = params[param_name].data[start:start + rows]
    if tuple(tensor.shape) != tuple(dst.shape):
        raise UnsupportedModelError(
            f"weight {name}: shape {tuple(tensor.shape)} does not match config.json's {tuple(dst.shape)}")
    dst.copy_(tensor)
