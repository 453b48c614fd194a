"""What both services read of a GGUF ``--model``: the model's config, tensor names, eos ids,
special tokens, chat template and fingerprint, from the file's metadata alone (no torch).

The config comes out in ``config.json``'s form (``hf_config``), so the executor checks it with the
same parser as a model directory's. The tensor table is checked against it at open time: a file
whose metadata says 9 heads of 64 but stores a 512-row ``attn_q`` fails here, naming both, before
any weight is read. The tokenizer is built in ``gguf_tokenizer.py``.

llama.cpp writes Mistral models with architecture ``llama`` (its converter treats them alike), so
``llama`` and ``qwen2`` cover Llama, SmolLM2, Mistral and Qwen2 files.
"""

from __future__ import annotations

import functools
import hashlib
import math
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType as Q

from pagedserve.gguf_file import GGUFError, GGUFFile

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
# What the executor dequantizes (gguf.quants): the brief's formats, and the ones llama.cpp's
# Q4_K_M / Q5_K_M mixes fall back on for rows that are not whole 256-element super-blocks.
SUPPORTED_TYPES = frozenset({Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q5_K,
                             Q.Q6_K})
# GGUF tensor names -> HF names (llama.cpp's tensor_mapping.py, for the tensors these models have).
_GLOBAL = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
_LAYER = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
ROPE_FREQS = "rope_freqs.weight"


def is_gguf(path: str | Path) -> bool:
    """Whether ``--model`` names a GGUF file (rather than a model directory)."""
    p = Path(path)
    if not p.is_file():
        return False
    if p.suffix.lower() == ".gguf":
        return True
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


@dataclass(frozen=True, slots=True)
class Expected:
    hf_name: str  # the HF checkpoint's name of this tensor
    shape: tuple[int, ...]


class GGUFModel:
    """A GGUF file checked as a model this server runs. Raises :class:`GGUFError` naming what is wrong."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.file = GGUFFile(self.path)
        self.meta = self.file.metadata
        self.arch = self._str("general.architecture")
        if self.arch not in ARCHITECTURES:
            raise GGUFError(f"{self.path}: architecture {self.arch!r} is not supported; supported: "
                            f"{', '.join(sorted(ARCHITECTURES))} (Mistral files are written as 'llama')")
        self.config = self._config()
        self.expected = self._expected()
        self._check_tensors()

    # -- metadata ---------------------------------------------------------------------------------
    def _str(self, key: str) -> str:
        value = self.meta.get(key)
        if not isinstance(value, str):
            raise GGUFError(f"{self.path}: metadata {key} is missing or not a string ({value!r})")
        return value

    def _int(self, key: str, default: int | None = None) -> int:
        value = self.meta.get(f"{self.arch}.{key}", default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise GGUFError(f"{self.path}: metadata {self.arch}.{key} must be a positive integer, got {value!r}")
        return value

    def _config(self) -> dict[str, Any]:
        hidden, heads = self._int("embedding_length"), self._int("attention.head_count")
        head_dim = self._int("attention.key_length", self.meta.get(f"{self.arch}.rope.dimension_count")
                             or hidden // heads)
        rotary = self.meta.get(f"{self.arch}.rope.dimension_count", head_dim)
        if rotary != head_dim:
            raise GGUFError(f"{self.path}: rope.dimension_count {rotary} != head dim {head_dim} (partial rotary "
                            f"embeddings are not supported)")
        embd = self.file.tensors.get("token_embd.weight")
        tokens = self.meta.get("tokenizer.ggml.tokens")
        vocab = self.meta.get(f"{self.arch}.vocab_size") or (embd.shape[0] if embd else None) \
            or (len(tokens) if isinstance(tokens, list) else None)
        if not isinstance(vocab, int) or vocab <= 0:
            raise GGUFError(f"{self.path}: no vocabulary size (no {self.arch}.vocab_size, token_embd or tokens)")
        if isinstance(tokens, list) and len(tokens) > vocab:
            raise GGUFError(f"{self.path}: {len(tokens)} tokenizer tokens but a vocabulary of {vocab}")
        eps = self.meta.get(f"{self.arch}.attention.layer_norm_rms_epsilon", 1e-5)
        llama = self.arch == "llama"
        return {
            "architectures": [ARCHITECTURES[self.arch]], "model_type": self.arch, "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": self._int("feed_forward_length"),
            "num_hidden_layers": self._int("block_count"), "num_attention_heads": heads,
            "num_key_value_heads": self._int("attention.head_count_kv", heads), "head_dim": head_dim,
            "rms_norm_eps": float(eps), "rope_theta": float(self.meta.get(f"{self.arch}.rope.freq_base", 10000.0)),
            "rope_scaling": self._rope_scaling(head_dim), "max_position_embeddings": self._int("context_length"),
            "tie_word_embeddings": "output.weight" not in self.file.tensors,
            "attention_bias": llama and "blk.0.attn_q.bias" in self.file.tensors,
            "hidden_act": "silu", "torch_dtype": self._dtype(),
            "eos_token_id": list(self.eos_token_ids), "bos_token_id": self.meta.get("tokenizer.ggml.bos_token_id"),
        }

    def _rope_scaling(self, head_dim: int) -> dict[str, Any] | None:
        kind = self.meta.get(f"{self.arch}.rope.scaling.type", "none")
        if kind == "linear":
            factor = self.meta.get(f"{self.arch}.rope.scaling.factor")
            if not isinstance(factor, (int, float)) or factor <= 0:
                raise GGUFError(f"{self.path}: linear rope scaling without a positive "
                                f"{self.arch}.rope.scaling.factor ({factor!r})")
            return {"rope_type": "linear", "factor": float(factor)}
        if kind != "none":
            raise GGUFError(f"{self.path}: rope scaling {kind!r} is not supported (supported: none, linear, "
                            f"and Llama 3's rope_freqs)")
        if ROPE_FREQS in self.file.tensors:
            return self._llama3_scaling(head_dim)
        return None

    def _llama3_scaling(self, head_dim: int) -> dict[str, Any]:
        """Llama 3.1+ files store RoPE's per-frequency factors (``rope_freqs``) instead of the
        rope_scaling they were computed from; the usual parameters are taken when they give those
        factors back, and the file is refused otherwise."""
        stored = np.asarray(self.file.raw(ROPE_FREQS), dtype=np.float64).reshape(-1)
        theta = float(self.meta.get(f"{self.arch}.rope.freq_base", 10000.0))
        params = {"rope_type": "llama3", "factor": float(stored.max()), "low_freq_factor": 1.0,
                  "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if stored.shape[0] != head_dim // 2 or not np.allclose(stored, llama3_factors(theta, head_dim, params),
                                                               rtol=1e-5):
            raise GGUFError(f"{self.path}: rope_freqs does not match Llama 3's RoPE scaling (factor "
                            f"{params['factor']}, frequency factors 1 and 4, 8192 positions): not supported")
        return params

    def _dtype(self) -> str:
        """The dtype ``--dtype auto`` loads on CUDA: float32 for an all-F32 file, else bfloat16."""
        types = {t.ggml_type for t in self.file.tensors.values()}
        return "float32" if types <= {Q.F32} else "bfloat16"

    @cached_property
    def eos_token_ids(self) -> tuple[int, ...]:
        """End-of-sequence, then end-of-turn and end-of-message ids: generation stops at any."""
        ids: list[int] = []
        for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
            value = self.meta.get(f"tokenizer.ggml.{key}")
            if isinstance(value, int) and not isinstance(value, bool) and value >= 0 and value not in ids:
                ids.append(value)
        return tuple(ids)

    def special_tokens(self) -> dict[str, str]:
        """bos_token, eos_token, ... as strings: what a chat template sees."""
        tokens = self.meta.get("tokenizer.ggml.tokens") or []
        out = {}
        for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                          ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
            tid = self.meta.get(f"tokenizer.ggml.{key}")
            if isinstance(tid, int) and 0 <= tid < len(tokens):
                out[name] = tokens[tid]
        return out

    def chat_template(self) -> str | None:
        value = self.meta.get("tokenizer.chat_template")
        if value is not None and not isinstance(value, str):
            raise GGUFError(f"{self.path}: tokenizer.chat_template must be a string")
        return value

    def fingerprint(self) -> str:
        """sha256 over the header (metadata and tensor table: names, shapes, types, offsets)."""
        return hashlib.sha256(b"gguf\n" + self.file.header_bytes).hexdigest()

    # -- tensors ----------------------------------------------------------------------------------
    def _expected(self) -> dict[str, Expected]:
        """GGUF tensor name -> its HF name and the shape the metadata implies."""
        c = self.config
        hidden, inter, hd = c["hidden_size"], c["intermediate_size"], c["head_dim"]
        q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
        out = {"token_embd.weight": Expected(_GLOBAL["token_embd.weight"], (c["vocab_size"], hidden)),
               "output_norm.weight": Expected(_GLOBAL["output_norm.weight"], (hidden,))}
        if not c["tie_word_embeddings"]:
            out["output.weight"] = Expected(_GLOBAL["output.weight"], (c["vocab_size"], hidden))
        shapes = {"attn_norm": (hidden,), "attn_q": (q, hidden), "attn_k": (kv, hidden), "attn_v": (kv, hidden),
                  "attn_output": (hidden, q), "ffn_norm": (hidden,), "ffn_gate": (inter, hidden),
                  "ffn_up": (inter, hidden), "ffn_down": (hidden, inter)}
        biases = {"attn_q": (q,), "attn_k": (kv,), "attn_v": (kv,)} if (
            self.arch == "qwen2" or c["attention_bias"]) else {}
        if c["attention_bias"]:
            biases["attn_output"] = (hidden,)
        for i in range(c["num_hidden_layers"]):
            for part, shape in shapes.items():
                out[f"blk.{i}.{part}.weight"] = Expected(f"model.layers.{i}.{_LAYER[part]}.weight", shape)
            for part, shape in biases.items():
                out[f"blk.{i}.{part}.bias"] = Expected(f"model.layers.{i}.{_LAYER[part]}.bias", shape)
        return out

    def _check_tensors(self) -> None:
        stored = self.file.tensors
        missing = [n for n in self.expected if n not in stored]
        if missing:
            raise GGUFError(f"{self.path}: {len(missing)} tensors missing, e.g. {missing[:3]}")
        extra = [n for n in stored if n not in self.expected and n != ROPE_FREQS]
        if extra:
            raise GGUFError(f"{self.path}: tensors this {self.arch} model does not use, e.g. {extra[:3]} "
                            f"(a variant this server does not implement?)")
        for name, exp in self.expected.items():
            info = stored[name]
            if info.shape != exp.shape:
                raise GGUFError(f"{self.path}: tensor {name} has shape {info.shape}, but the metadata implies "
                                f"{exp.shape}: metadata and tensors disagree")
            if info.ggml_type not in SUPPORTED_TYPES:
                raise GGUFError(f"{self.path}: tensor {name} is stored as {info.ggml_type.name}, which is not "
                                f"supported; supported: {', '.join(sorted(t.name for t in SUPPORTED_TYPES))}")


@functools.lru_cache(maxsize=4)
def open_gguf(path: Path) -> GGUFModel:
    """The checked file, read once per process (config, tokenizer, template, eos ids all come from it)."""
    return GGUFModel(path)


def llama3_factors(theta: float, head_dim: int, p: dict[str, Any]) -> list[float]:
    """The per-frequency RoPE factors llama.cpp's converter writes for Llama 3's rope_scaling."""
    low_wavelen = p["original_max_position_embeddings"] / p["low_freq_factor"]
    high_wavelen = p["original_max_position_embeddings"] / p["high_freq_factor"]
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * theta ** (i / head_dim)
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(p["factor"])
        else:
            smooth = (p["original_max_position_embeddings"] / wavelen - p["low_freq_factor"]) / (
                p["high_freq_factor"] - p["low_freq_factor"])
            out.append(1 / ((1 - smooth) / p["factor"] + smooth))
    return out
