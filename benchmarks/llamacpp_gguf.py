"""``cpu_vs_llamacpp --gguf FILE``: both servers on one GGUF file per format.

The file's own format runs as it is; every other format is the file converted
(``testing/gguf_convert.py``: every matrix dequantized and stored again as F32, BF16 or Q8_0,
cached beside llama.cpp's build), so both servers always load the same bytes. pagedserve keeps
the quantized formats' blocks (``--quantization gguf``) and dequantizes nothing else: BF16 is
computed as bfloat16 (exact), F32 as float32. The KV cache is bfloat16 on both sides except for
f32 (float32), as for the checkpoints' int8 row.
"""

from __future__ import annotations

from pathlib import Path

from gguf import GGMLQuantizationType as Q

# format -> (ggml type, pagedserve executor flags, KV cache type for both)
FORMATS = {
    "q4_1": (Q.Q4_1, ["--quantization", "gguf", "--dtype", "bfloat16"], "bf16"),
    "q4_0": (Q.Q4_0, ["--quantization", "gguf", "--dtype", "bfloat16"], "bf16"),
    "q8_0": (Q.Q8_0, ["--quantization", "gguf", "--dtype", "bfloat16"], "bf16"),
    "bf16": (Q.BF16, ["--dtype", "bfloat16"], "bf16"),
    "f32": (Q.F32, ["--dtype", "float32"], "f32"),
}


def files(src: Path, fmts: list[str], cache: Path) -> dict[str, Path]:
    """Each format's file: ``src`` itself for its own type, else a converted copy (cached by ``src``'s
    fingerprint)."""
    from pagedserve.gguf_model import GGUFModel
    from pagedserve.wire.fingerprint import model_fingerprint
    from testing.gguf_convert import convert

    unknown = set(fmts) - set(FORMATS)
    if unknown:
        raise SystemExit(f"--gguf formats: {', '.join(FORMATS)}, got {', '.join(sorted(unknown))}")
    own = _decoder_type(GGUFModel(src))
    out = {}
    for fmt in fmts:
        qtype = FORMATS[fmt][0]
        if qtype == own:
            out[fmt] = src
            continue
        dst = cache / "gguf" / f"{src.stem}-{model_fingerprint(src)[:12]}-{fmt}.gguf"
        if not dst.is_file():
            dst.parent.mkdir(parents=True, exist_ok=True)
            print(f"converting {src.name} to {fmt} ...", flush=True)
            convert(src, dst.with_suffix(".tmp"), qtype).replace(dst)
        out[fmt] = dst
    return out


def _decoder_type(model) -> Q:
    types = [t.ggml_type for n, t in model.file.tensors.items() if n.startswith("blk.") and len(t.shape) == 2]
    return max(set(types), key=types.count)


def vocab_size(path: Path) -> int:
    from pagedserve.gguf_model import GGUFModel

    return GGUFModel(path).config["vocab_size"]


def step_bytes(path: Path, kv_type: str, ctx: float) -> tuple[float, float]:
    """(weight bytes, KV bytes) of a batch-1 decode step on ``path``: every matrix as stored (the
    embedding table counts as the LM head only where it is tied; a lookup reads one row), plus the
    K/V of ``ctx`` tokens."""
    from pagedserve.gguf_model import GGUFModel

    model = GGUFModel(path)
    c, tensors = model.config, model.file.tensors
    weights = sum(t.nbytes for n, t in tensors.items() if len(t.shape) == 2 and
                  (n != "token_embd.weight" or c["tie_word_embeddings"]))
    kv = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * {"f32": 4, "bf16": 2}[kv_type] * ctx
    return weights, kv
