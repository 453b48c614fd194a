"""Random-weight Llama checkpoints of real models' shapes, written in seconds (timing only).

``make gpu-check`` times the executor on a model of a real size without downloading one: the
shape is what sets a step's cost. The checkpoint is a ``config.json`` and one
``model.safetensors`` in transformers' naming, so the executor and transformers both load it;
there is no tokenizer (the timing feeds token ids). Weights are drawn on the given device (a GPU
draws 2 GB in milliseconds) with a 1/sqrt(fan-in) scale, so activations stay finite.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

SHAPES: dict[str, dict[str, int]] = {
    # The 1.1B-parameter Llama of issue #45's measurements: 2.2 GB of bfloat16 weights.
    "llama-1.1b-shape": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                             num_attention_heads=32, num_key_value_heads=8, vocab_size=32000),
    # Small enough for the CPU tests of the code that uses the shapes above.
    "test-shape": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=256),
}


def write_shaped_llama(out_dir: str | Path, shape: str, dtype: torch.dtype = torch.bfloat16,
                       device: str = "cpu", seed: int = 0, max_position_embeddings: int = 4096) -> Path:
    """Write the checkpoint of ``shape`` (a key of SHAPES) into ``out_dir``; returns it."""
    from safetensors.torch import save_file

    if shape not in SHAPES:
        raise ValueError(f"shape: expected one of {tuple(SHAPES)}, got {shape!r}")
    s = SHAPES[shape]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hidden, inter, vocab = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    head = hidden // s["num_attention_heads"]
    kv = s["num_key_value_heads"] * head
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
              "max_position_embeddings": max_position_embeddings, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "torch_dtype": str(dtype).removeprefix("torch."),
              "bos_token_id": 1, "eos_token_id": 2, **s}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    gen = torch.Generator(device=device).manual_seed(seed)

    def w(rows: int, cols: int) -> torch.Tensor:
        t = torch.randn(rows, cols, generator=gen, device=device, dtype=torch.float32) / cols ** 0.5
        return t.to(dtype).cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=dtype)

    tensors = {"model.embed_tokens.weight": w(vocab, hidden), "model.norm.weight": ones(hidden),
               "lm_head.weight": w(vocab, hidden)}
    for i in range(s["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors |= {p + "self_attn.q_proj.weight": w(hidden, hidden), p + "self_attn.k_proj.weight": w(kv, hidden),
                    p + "self_attn.v_proj.weight": w(kv, hidden), p + "self_attn.o_proj.weight": w(hidden, hidden),
                    p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
                    p + "mlp.down_proj.weight": w(hidden, inter), p + "input_layernorm.weight": ones(hidden),
                    p + "post_attention_layernorm.weight": ones(hidden)}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def write_word_tokenizer(model_dir: str | Path, vocab_size: int) -> Path:
    """A word-level ``tokenizer.json`` with one word per id of the model's vocabulary ("w3", "w4",
    ...; ids 0-2 are <unk>, <s>, </s>), so that the scheduler can serve a shaped model: any id the
    random weights pick detokenizes. Returns the file."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    path = Path(model_dir) / "tokenizer.json"
    tok.save(str(path))
    return path
