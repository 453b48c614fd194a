"""Llama-family models (Llama, Mistral, Qwen2) in plain torch, loaded from HF safetensors."""

from executor_svc.model.architecture import (
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    UnsupportedModelError,
    load_model_config,
    parse_model_config,
)
from executor_svc.model.llama import LlamaForCausalLM
from executor_svc.model.loader import load_model
from pagedserve.wire.fingerprint import checkpoint_manifest, model_fingerprint

__all__ = [
    "SUPPORTED_ARCHITECTURES", "LlamaForCausalLM", "ModelConfig", "UnsupportedModelError",
    "checkpoint_manifest", "load_model", "load_model_config", "model_fingerprint", "parse_model_config",
]
