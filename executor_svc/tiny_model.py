"""Write a seeded random-weight Llama-family checkpoint with a locally trained tokenizer.

``python -m executor_svc.tiny_model --out DIR [--arch llama|mistral|qwen2] [--size default|small]``

The result is a real HF model directory (config.json, safetensors written by
``save_pretrained``, tokenizer.json + tokenizer_config.json, a ChatML
chat_template.jinja) that both our
executor and transformers load, so tests compare the two and demos run with no
download. The tokenizer is a byte-level BPE trained on ``data/corpus.txt`` (a
small generated English-like corpus), so every id decodes; the model's
vocab_size equals the tokenizer's.

Weights are scaled so each layer's output is larger than its input (std
2/sqrt(fan_in) for projections; embeddings std 1, or 2/sqrt(hidden) when tied
so the logits of the current token do not dominate): with HF's default 0.02 a
random model's greedy output collapses onto one repeated token. tests/ check
that greedy continuations keep changing.
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path
from typing import Any

import torch

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
EOS_TOKEN = "<|endoftext|>"
# ChatML (Qwen2's format), written as chat_template.jinja so the HTTP front can serve chat
# (`make run` shows a call). The markers are plain text to this tokenizer: its vocabulary,
# and so every test's token ids, stay as they were.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

SIZES: dict[str, dict[str, int]] = {
    # ~30M parameters: compute dominates a CPU step, as with a real model.
    "default": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                    num_key_value_heads=4, vocab=8192),
    # For fast tests: a few hundred thousand parameters.
    "small": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab=512),
    # Tensor-parallel tests: 8 q / 4 KV heads of 16 and 256 MLP columns split 2, 4 or 8 ways.
    "tp": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=8,
               num_key_value_heads=4, vocab=512),
}
ARCHS = ("llama", "mistral", "qwen2")


def train_tokenizer(vocab_size: int):
    """Byte-level BPE on the shipped corpus; id 0 is the EOS token."""
    from tokenizers import Tokenizer

    return Tokenizer.from_str(_trained_tokenizer_json(vocab_size))


@functools.lru_cache(maxsize=4)
def _trained_tokenizer_json(vocab_size: int) -> str:
    """Training is deterministic; cache it so a test session builds many checkpoints quickly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train([str(CORPUS)], trainer)
    return tok.to_str()


def _hf_config(arch: str, size: dict[str, int], vocab: int, eos_id: int, tie: bool,
               rope_parameters: dict[str, Any] | None, num_key_value_heads: int | None = None):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    cls = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[arch]
    dims = {k: v for k, v in size.items() if k != "vocab"}
    if num_key_value_heads is not None:
        dims["num_key_value_heads"] = num_key_value_heads
    kwargs: dict[str, Any] = dict(vocab_size=vocab, max_position_embeddings=4096, rms_norm_eps=1e-6,
                                  tie_word_embeddings=tie, bos_token_id=eos_id, eos_token_id=eos_id,
                                  pad_token_id=None, **dims)
    if rope_parameters is not None:
        kwargs["rope_parameters"] = rope_parameters
    if arch == "mistral":
        kwargs["sliding_window"] = 4096
    return cls(**kwargs)


@torch.no_grad()
def _init_weights(model: torch.nn.Module, seed: int, tied: bool, hidden: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    emb_std = 2.0 / hidden ** 0.5 if tied else 1.0
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # near 1, not exactly, so a mis-loaded norm shows
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn(p.shape, generator=gen))
        elif "embed_tokens" in name:
            p.copy_(emb_std * torch.randn(p.shape, generator=gen))
        else:  # projections and an untied lm_head
            p.copy_(2.0 * torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)


def build_tiny_model(out_dir: str | Path, arch: str = "llama", size: str = "default", *, seed: int = 0,
                     tie_word_embeddings: bool | None = None, rope_parameters: dict[str, Any] | None = None,
                     max_shard_size: str | None = None, num_key_value_heads: int | None = None) -> Path:
    """Write the checkpoint; returns its directory. Tied embeddings default on for qwen2 only;
    ``num_key_value_heads`` overrides the size's (e.g. 1: multi-query attention)."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    if arch not in ARCHS:
        raise ValueError(f"arch: expected one of {ARCHS}, got {arch!r}")
    if size not in SIZES:
        raise ValueError(f"size: expected one of {tuple(SIZES)}, got {size!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = train_tokenizer(SIZES[size]["vocab"])
    eos_id = tok.token_to_id(EOS_TOKEN)
    tie = arch == "qwen2" if tie_word_embeddings is None else tie_word_embeddings
    config = _hf_config(arch, SIZES[size], tok.get_vocab_size(), eos_id, tie, rope_parameters, num_key_value_heads)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _init_weights(model, seed, tie, config.hidden_size)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(out, **kwargs)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN,
                                   chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m executor_svc.tiny_model", description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="directory to write the checkpoint into")
    parser.add_argument("--arch", choices=ARCHS, default="llama")
    parser.add_argument("--size", choices=tuple(SIZES), default="default")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    path = build_tiny_model(args.out, args.arch, args.size, seed=args.seed)
    print(f"wrote {args.arch} ({args.size}) checkpoint to {path}")


if __name__ == "__main__":
    main()
