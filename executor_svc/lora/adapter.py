"""Read one PEFT LoRA adapter directory into float32 tensors checked against the base model.

PEFT's format: ``adapter_config.json`` (r, lora_alpha, target_modules, ...) and
``adapter_model.safetensors`` whose tensors are named
``base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}.weight`` with
A [r, in] and B [out, r]. The tensors are authoritative for which layers and projections the
adapter touches (``target_modules`` may be a regex, ``layers_to_transform`` may skip layers);
the config gives r and the scaling. Everything is checked before anything is returned, so a
refused adapter leaves nothing behind; a weight PEFT would apply that we would ignore is refused,
never dropped silently (an ignored adapter would serve base-model outputs under its name).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from executor_svc.model.architecture import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_RANK = 256  # the largest max_rank a LoraSlots accepts (slots are preallocated at max_rank)
ATTN_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTN_MODULES + MLP_MODULES
_KEY = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


class LoraError(ValueError):
    """An adapter that cannot be served, or a slot misuse; the message names the problem."""


@dataclass(frozen=True, slots=True)
class LoraAdapter:
    """One adapter, validated: ``weights[(layer, module)] = (A [r, in], B [out, r])`` float32,
    ``scaling`` not yet applied (LoraSlots folds it into B)."""

    path: str
    rank: int
    scaling: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def modules(self) -> set[str]:
        return {m for _, m in self.weights}


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(out, in) of an HF projection of the whole (unsharded) base model."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    return {"q_proj": (q, cfg.hidden_size), "k_proj": (kv, cfg.hidden_size), "v_proj": (kv, cfg.hidden_size),
            "o_proj": (cfg.hidden_size, q), "gate_proj": (cfg.intermediate_size, cfg.hidden_size),
            "up_proj": (cfg.intermediate_size, cfg.hidden_size),
            "down_proj": (cfg.hidden_size, cfg.intermediate_size)}[module]


def _read_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise LoraError(f"LoRA adapter {path}: {CONFIG_FILE} not found")
    try:
        raw = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraError(f"LoRA adapter {path}: {CONFIG_FILE} is not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise LoraError(f"LoRA adapter {path}: {CONFIG_FILE} must hold a JSON object")
    return raw


def _check_features(path: Path, raw: dict) -> None:
    """Refuse every PEFT option that changes the computation beyond x A^T B^T * scaling."""
    peft_type = raw.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoraError(f"LoRA adapter {path}: peft_type {peft_type!r} is not supported (LORA only)")
    if raw.get("bias", "none") != "none":
        raise LoraError(f"LoRA adapter {path}: bias={raw['bias']!r} is not supported (bias='none' only)")
    unsupported = {
        "use_dora": "DoRA (use_dora)",
        "lora_bias": "a bias on lora_B (lora_bias)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layers)",
        "modules_to_save": "modules_to_save (fully trained extra modules)",
        "rank_pattern": "layer-specific ranks (rank_pattern)",
        "alpha_pattern": "layer-specific alphas (alpha_pattern)",
        "layer_replication": "layer_replication",
        "target_parameters": "target_parameters",
    }
    for key, what in unsupported.items():
        if raw.get(key):
            raise LoraError(f"LoRA adapter {path}: {what} is not supported")


def _rank_and_scaling(path: Path, raw: dict, max_rank: int) -> tuple[int, float]:
    r, alpha = raw.get("r"), raw.get("lora_alpha", raw.get("r"))
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise LoraError(f"LoRA adapter {path}: r must be a positive integer, got {r!r}")
    if r > max_rank:
        raise LoraError(f"LoRA adapter {path}: rank r={r} exceeds max_rank {max_rank}")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise LoraError(f"LoRA adapter {path}: lora_alpha must be a number, got {alpha!r}")
    # PEFT: alpha / r, or with rsLoRA alpha / sqrt(r) (lora/layer.py, update_layer).
    return r, alpha / (math.sqrt(r) if raw.get("use_rslora") else r)


def _check_targets(path: Path, raw: dict) -> None:
    """A list of target_modules must name projections our model has (a regex string is checked
    through the tensors it produced)."""
    targets = raw.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(set(targets) - set(MODULES))
        if unknown:
            raise LoraError(f"LoRA adapter {path}: target module(s) {unknown} not in the base model "
                            f"(supported: {', '.join(MODULES)})")


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    file = path / WEIGHTS_FILE
    if not file.is_file():
        pickled = " (adapter_model.bin is pickle, never loaded: save with safe_serialization=True)" \
            if (path / "adapter_model.bin").exists() else ""
        raise LoraError(f"LoRA adapter {path}: {WEIGHTS_FILE} not found{pickled}")
    from safetensors.torch import load_file

    try:
        return load_file(str(file))
    except Exception as e:  # noqa: BLE001 (safetensors raises its own error types and OSError)
        raise LoraError(f"LoRA adapter {path}: {WEIGHTS_FILE} is corrupt or unreadable ({e})") from e


def _parse(path: Path, tensors: dict[str, torch.Tensor], cfg: ModelConfig,
           r: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _KEY.fullmatch(name)
        if m is None:
            raise LoraError(f"LoRA adapter {path}: unsupported tensor {name!r} (only lora_A/lora_B of "
                            f"{', '.join(MODULES)} in the decoder layers)")
        layer, group, module, ab = int(m[1]), m[2], m[3], m[4]
        if module not in MODULES or (module in ATTN_MODULES) != (group == "self_attn"):
            raise LoraError(f"LoRA adapter {path}: target module {group}.{module} ({name}) not in the base model")
        if layer >= cfg.num_layers:
            raise LoraError(f"LoRA adapter {path}: tensor {name} is for layer {layer}; the base model has "
                            f"{cfg.num_layers} layers")
        if t.dtype not in _FLOATS:
            raise LoraError(f"LoRA adapter {path}: tensor {name} has dtype {t.dtype} (float32/bfloat16/float16 only)")
        parts.setdefault((layer, module), {})[ab] = t
    weights = {}
    for (layer, module), ab in sorted(parts.items()):
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {path}: layer {layer} {module} has lora_{''.join(ab)} without its pair")
        out, n_in = module_shape(cfg, module)
        a, b = ab["A"], ab["B"]
        if tuple(a.shape) != (r, n_in) or tuple(b.shape) != (out, r):
            raise LoraError(f"LoRA adapter {path}: layer {layer} {module} shapes A {tuple(a.shape)}, B "
                            f"{tuple(b.shape)} disagree with the base model's and r={r}: expected A {(r, n_in)}, "
                            f"B {(out, r)}")
        a, b = a.to(torch.float32).contiguous(), b.to(torch.float32).contiguous()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise LoraError(f"LoRA adapter {path}: layer {layer} {module} holds non-finite weights")
        weights[layer, module] = (a, b)
    if not weights:
        raise LoraError(f"LoRA adapter {path}: {WEIGHTS_FILE} holds no LoRA weights")
    return weights


def load_adapter(path: str | Path, cfg: ModelConfig, max_rank: int) -> LoraAdapter:
    """The adapter at ``path`` for a base model of config ``cfg`` (whole, unsharded), float32;
    raises LoraError naming the problem. ``base_model_name_or_path`` is informational only."""
    p = Path(path)
    if not p.is_dir():
        raise LoraError(f"LoRA adapter {p}: not a directory")
    raw = _read_config(p)
    _check_features(p, raw)
    r, scaling = _rank_and_scaling(p, raw, max_rank)
    _check_targets(p, raw)
    weights = _parse(p, _read_tensors(p), cfg, r)
    return LoraAdapter(str(p), r, scaling, weights)
