"""Parse an HF ``config.json`` into the few numbers our transformer needs.

Read robustly: transformers 5 writes rotary settings to ``rope_parameters``
(with ``rope_theta`` inside), older checkpoints use top-level ``rope_theta``
plus ``rope_scaling`` (``type`` or ``rope_type``). Anything we do not implement
is refused here, at start-up, naming the field and what is supported.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


class UnsupportedModelError(ValueError):
    """The checkpoint uses an architecture or feature this executor does not implement."""


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # one of SUPPORTED_ROPE_TYPES
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int  # already capped by a sliding window, see _max_len
    tie_word_embeddings: bool
    qkv_bias: bool  # Qwen2 always; Llama/Mistral with attention_bias
    o_bias: bool  # Llama/Mistral with attention_bias
    torch_dtype: str  # as stored in the checkpoint ("float32", "bfloat16", ...)
    eos_token_ids: tuple[int, ...]


def load_model_config(model_dir: str | Path) -> ModelConfig:
    """The config of an HF model directory, or of a GGUF file (its metadata in config.json's form)."""
    if Path(model_dir).is_file():
        from pagedserve.model_dir import open_gguf

        return parse_model_config(open_gguf(Path(model_dir)).config)
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: --model must be an HF model directory or a GGUF file")
    with open(path, encoding="utf-8") as f:
        return parse_model_config(json.load(f))


def _req(raw: dict[str, Any], key: str, kind: type = int) -> Any:
    if key not in raw or raw[key] is None:
        raise UnsupportedModelError(f"config.json: missing required field {key!r}")
    value = raw[key]
    if kind is float and isinstance(value, int):
        value = float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise UnsupportedModelError(f"config.json: field {key!r} must be {kind.__name__}, got {value!r}")
    return value


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    if not archs:  # fall back on model_type (configs saved without a model class)
        by_type = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        arch = by_type.get(str(raw.get("model_type")))
        if arch is None:
            raise UnsupportedModelError(
                f"config.json: no 'architectures' and model_type {raw.get('model_type')!r} is not one of "
                f"{sorted(by_type)}; supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}")
        return arch
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
        raise UnsupportedModelError(
            f"config.json: architecture {archs} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return archs[0]


def _rope(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise UnsupportedModelError(f"config.json: rope_parameters must be a mapping, got {params!r}")
    if "full_attention" in params and isinstance(params["full_attention"], dict):
        params = params["full_attention"]  # per-layer-type form; we only run full attention
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedModelError(
            f"config.json: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError("config.json: partial_rotary_factor != 1.0 is not supported")
    if rope_type == "default":
        return RopeConfig(theta=float(theta))
    factor = float(_req(params, "factor", float))
    if rope_type == "linear":
        return RopeConfig(theta=float(theta), rope_type="linear", factor=factor)
    missing = [k for k in _LLAMA3_KEYS if k not in params]
    if missing:
        raise UnsupportedModelError(f"config.json: llama3 rope scaling lacks {missing}")
    return RopeConfig(
        theta=float(theta), rope_type="llama3", factor=factor,
        low_freq_factor=float(params["low_freq_factor"]), high_freq_factor=float(params["high_freq_factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]))


def _max_len(raw: dict[str, Any], arch: str) -> int:
    """Longest context we serve exactly.

    We implement full attention only. A sliding window (Mistral, Qwen2 with
    use_sliding_window) changes nothing for contexts no longer than the window,
    so we cap the model length at the window instead of implementing it.
    """
    max_len = _req(raw, "max_position_embeddings")
    window = raw.get("sliding_window")
    uses_window = arch == "MistralForCausalLM" or bool(raw.get("use_sliding_window"))
    if uses_window and isinstance(window, int) and window > 0:
        max_len = min(max_len, window)
    return max_len


def _eos_ids(raw: dict[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    arch = _architecture(raw)
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"config.json: hidden_act {act!r} is not supported; supported: 'silu'")
    if raw.get("mlp_bias"):
        raise UnsupportedModelError("config.json: mlp_bias=true is not supported")
    hidden = _req(raw, "hidden_size")
    heads = _req(raw, "num_attention_heads")
    kv_heads = raw.get("num_key_value_heads") or heads
    if heads % kv_heads:
        raise UnsupportedModelError(f"config.json: num_attention_heads {heads} not divisible by "
                                    f"num_key_value_heads {kv_heads}")
    attention_bias = bool(raw.get("attention_bias", False))
    return ModelConfig(
        architecture=arch, vocab_size=_req(raw, "vocab_size"), hidden_size=hidden,
        intermediate_size=_req(raw, "intermediate_size"), num_layers=_req(raw, "num_hidden_layers"),
        num_heads=heads, num_kv_heads=kv_heads, head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope=_rope(raw),
        max_position_embeddings=_max_len(raw, arch),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
        o_bias=arch != "Qwen2ForCausalLM" and attention_bias,
        torch_dtype=str(raw.get("torch_dtype") or raw.get("dtype") or "float32"),
        eos_token_ids=_eos_ids(raw),
    )
