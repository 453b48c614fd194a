"""Small GGUF files for the tests, written as llama.cpp's converter writes them (gguf.GGUFWriter).

Random weights (std 0.02) in one ggml type for every matrix, norms in F32; llama files get
llama.cpp's Q/K row permutation, so loading them proves the reverse. ``gguf.quants.quantize``
writes the 32-element formats; it cannot quantize K-quants, so their blocks are written directly:
random quants with small, finite scales (any valid block is a fair test: both loaders dequantize
the same bytes). The vocabulary is a tiny model directory's byte-level BPE (tokenizer.json) or a SentencePiece BPE
trained here (Llama 2 / Mistral files carry one).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

# K-quant byte layouts: (block bytes, [(offset of an f16 scale, its size)])
_K_SCALES = {Q.Q4_K: (144, [(0, 3e-5), (2, 3e-5)]), Q.Q5_K: (176, [(0, 1.5e-5), (2, 1.5e-5)]),
             Q.Q6_K: (210, [(208, 1e-5)]), Q.Q2_K: (84, [(80, 1e-4), (82, 1e-4)])}
# Sizes whose rows are whole 256-element super-blocks (K-quants need them).
SIZES = dict(hidden=256, intermediate=512, layers=2, heads=4, kv_heads=2, context=512)


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (HF halves -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _stored(w: np.ndarray, qtype: Q, rng: np.random.Generator) -> np.ndarray:
    if qtype not in _K_SCALES:
        return gguf.quants.quantize(w, qtype)
    return k_quant_rows(qtype, *w.shape, rng)


def k_quant_rows(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 256 * block bytes] uint8 of random ``qtype`` super-blocks (cols: whole ones)."""
    block, scales = _K_SCALES[qtype]
    data = rng.integers(0, 256, size=(rows, cols // 256, block), dtype=np.uint8)
    for offset, size in scales:
        d = rng.uniform(0.5 * size, size, size=(rows, cols // 256)).astype(np.float16)
        data[:, :, offset:offset + 2] = d.view(np.uint8).reshape(rows, cols // 256, 2)
    if qtype == Q.Q6_K:  # its 16 sub-block scales are int8: keep them small
        data[:, :, 192:208] = rng.integers(-20, 20, size=(rows, cols // 256, 16)).astype(np.int8).view(np.uint8)
    return data.reshape(rows, -1)


def byte_level_vocab(tokenizer_dir: Path) -> dict[str, object]:
    """A tiny model directory's byte-level BPE (tokenizer.json) as GGUF tokenizer metadata."""
    tok = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab: dict[str, int] = tok["model"]["vocab"]
    added = {t["content"]: t["id"] for t in tok.get("added_tokens", [])}
    tokens = [""] * (max([*vocab.values(), *added.values()]) + 1)
    for t, i in {**vocab, **added}.items():
        tokens[i] = t
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3 if t in added else 1 for t in tokens],
            "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]],
            "tokenizer.ggml.eos_token_id": added.get("<|endoftext|>", 0), "tokenizer.ggml.add_bos_token": False}


def sentencepiece_vocab(text: list[str], vocab_size: int = 320) -> dict[str, object]:
    """A SentencePiece BPE trained on ``text``, as llama.cpp writes one (tokens, scores, types; no merges)."""
    import io

    import sentencepiece as spm

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_writer=buf, model_type="bpe",
                                   vocab_size=vocab_size, byte_fallback=True, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_proto=buf.getvalue())
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(n)]
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
            "tokenizer.ggml.scores": [float(sp.get_score(i)) for i in range(n)], "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": sp.bos_id(), "tokenizer.ggml.eos_token_id": sp.eos_id(),
            "tokenizer.ggml.unknown_token_id": sp.unk_id(), "_processor": sp}


def write_gguf(path: Path, tokenizer_dir: Path | None, arch: str = "llama", qtype: Q = Q.Q8_0, *,
               tied: bool = False, seed: int = 0, sizes: dict[str, int] | None = None, edit=None,
               vocab: dict[str, object] | None = None) -> Path:
    """A GGUF model of ``arch`` (llama, qwen2) with every matrix in ``qtype``; its tokenizer is
    ``vocab`` (GGUF tokenizer metadata) or else ``tokenizer_dir``'s. ``edit(meta, tensors)`` may
    change the metadata or tensors before writing (for the bad-file tests)."""
    s = dict(SIZES, **(sizes or {}))
    rng = np.random.default_rng(seed)
    vocab = {k: v for k, v in (vocab or byte_level_vocab(tokenizer_dir)).items() if not k.startswith("_")}
    n_vocab = len(vocab["tokenizer.ggml.tokens"])
    h, inter, hd = s["hidden"], s["intermediate"], s["hidden"] // s["heads"]
    meta: dict[str, object] = {
        f"{arch}.context_length": s["context"], f"{arch}.embedding_length": h,
        f"{arch}.feed_forward_length": inter, f"{arch}.block_count": s["layers"],
        f"{arch}.attention.head_count": s["heads"], f"{arch}.attention.head_count_kv": s["kv_heads"],
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-5, f"{arch}.rope.freq_base": 10000.0,
        f"{arch}.rope.dimension_count": hd, f"{arch}.vocab_size": n_vocab, **vocab,
    }

    def matrix(rows: int, cols: int) -> np.ndarray:
        return rng.normal(0, 0.02, size=(rows, cols)).astype(np.float32)

    tensors: dict[str, tuple[np.ndarray, Q]] = {"token_embd.weight": (matrix(n_vocab, h), qtype),
                                                "output_norm.weight": (1 + matrix(1, h)[0], Q.F32)}
    if not tied:
        tensors["output.weight"] = (matrix(n_vocab, h), qtype)
    q, kv = s["heads"] * hd, s["kv_heads"] * hd
    for i in range(s["layers"]):
        b = f"blk.{i}."
        wq, wk = matrix(q, h), matrix(kv, h)
        if arch == "llama":
            wq, wk = llama_permute(wq, s["heads"]), llama_permute(wk, s["kv_heads"])
        tensors.update({b + "attn_norm.weight": (1 + matrix(1, h)[0], Q.F32), b + "attn_q.weight": (wq, qtype),
                        b + "attn_k.weight": (wk, qtype), b + "attn_v.weight": (matrix(kv, h), qtype),
                        b + "attn_output.weight": (matrix(h, q), qtype),
                        b + "ffn_norm.weight": (1 + matrix(1, h)[0], Q.F32),
                        b + "ffn_gate.weight": (matrix(inter, h), qtype), b + "ffn_up.weight": (matrix(inter, h), qtype),
                        b + "ffn_down.weight": (matrix(h, inter), qtype)})
        if arch == "qwen2":
            for part, n in (("attn_q", q), ("attn_k", kv), ("attn_v", kv)):
                tensors[f"{b}{part}.bias"] = (matrix(1, n)[0], Q.F32)
    if edit is not None:
        edit(meta, tensors)
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in meta.items():
        _add(writer, key, value)
    for name, (w, t) in tensors.items():
        if t == Q.F32:
            writer.add_tensor(name, w.astype(np.float32))
        elif t == Q.F16:
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, _stored(w, t, rng), raw_dtype=t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _add(writer: gguf.GGUFWriter, key: str, value: object) -> None:
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):
        writer.add_array(key, value)
    else:
        raise TypeError(f"{key}: {type(value).__name__}")


def gguf_to_hf_dir(gguf_path: Path, out_dir: Path) -> Path:
    """A GGUF model as a transformers directory (config.json, float32 safetensors, tokenizer.json):
    the weights dequantized as the executor's loader does it, for builds that read no GGUF file
    (benchmarks comparing with an older build serve both from this directory)."""
    from safetensors.torch import save_file

    from executor_svc.model.gguf_weights import gguf_tensors
    from pagedserve.gguf_model import GGUFModel
    from pagedserve.gguf_tokenizer import build_tokenizer

    model = GGUFModel(gguf_path)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = dict(model.config, architectures=[model.config.get("architectures", ["LlamaForCausalLM"])[0]],
                  torch_dtype="float32")
    (out_dir / "config.json").write_text(json.dumps(config, indent=1))
    wanted = {exp.hf_name for exp in model.expected.values()}
    save_file(dict(gguf_tensors(model, wanted)), str(out_dir / "model.safetensors"))
    build_tokenizer(model).save(str(out_dir / "tokenizer.json"))
    template = model.chat_template()
    (out_dir / "tokenizer_config.json").write_text(json.dumps(
        {**({"chat_template": template} if template else {}), **model.special_tokens()}, indent=1))
    return out_dir
