"""Minimal PEFT adapter directories for tests of what reads only their files (the scheduler's
checks in ``pagedserve/lora_modules.py``): a config and a safetensors file of the given shapes,
values arbitrary. Adapters whose values matter are made by PEFT itself (``testing/lora_adapters.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file

_OWNER = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_peft_dir(path: Path, r: int = 8, targets: tuple[str, ...] = ("q_proj", "v_proj"), layers: int = 2,
                   width: int = 32, **config) -> Path:
    """A PEFT LoRA directory at ``path`` (created); ``config`` overrides adapter_config.json's fields."""
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets), "bias": "none",
           "base_model_name_or_path": "tiny-llama", **config}
    (path / "adapter_config.json").write_text(json.dumps(cfg))
    tensors = {}
    for layer in range(layers):
        for t in targets:
            stem = f"base_model.model.model.layers.{layer}.{_OWNER.get(t, 'mlp')}.{t}"
            tensors[f"{stem}.lora_A.weight"] = np.ones((r, width), np.float32)
            tensors[f"{stem}.lora_B.weight"] = np.ones((width, r), np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path
