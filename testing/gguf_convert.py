"""A GGUF file's weights written again in another ggml type, or as a float32 safetensors
checkpoint: the same model, other bytes.

``convert(src, dst, qtype)`` dequantizes every matrix of ``src`` (``gguf.quants``) and stores it
as ``qtype`` (F32, F16, BF16, a format ``gguf.quants.quantize`` writes: Q8_0, Q4_0, Q4_1, or Q4_K
through ``testing/q4_k_quantize.py``, where a matrix whose rows are not whole 256-weight
super-blocks stays F32, as llama.cpp falls back to another type for those),
with every metadata key (tokenizer, chat template, ...) copied as it is typed in ``src`` and
``general.file_type`` set to match. Vectors (norms) stay as stored. The benchmarks use it to
give pagedserve and llama.cpp one model in several formats (SmolLM2's Q4_1 file as F32, BF16 and
Q8_0: the weights llama.cpp's converter would write from the dequantized checkpoint), and the
agreement measurement to round those weights as each format does. ``to_safetensors`` writes the
dequantized weights under their HF names with the file's config (what ``--quantization int8``
is measured on).
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize, quantize

from testing.q4_k_quantize import QK_K, quantize_q4_k

# llama.cpp's LLAMA_FTYPE of a file whose matrices are all of one type
FILE_TYPES = {Q.F32: 0, Q.F16: 1, Q.Q4_0: 2, Q.Q4_1: 3, Q.Q8_0: 7, Q.Q4_K: 15, Q.BF16: 32}


def convert(src: Path, dst: Path, qtype: Q) -> Path:
    if qtype not in FILE_TYPES:
        raise ValueError(f"convert: one of {', '.join(t.name for t in FILE_TYPES)}, got {qtype.name}")
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue  # (the header's own counts; written by the writer; set below)
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type=sub)
    writer.add_file_type(FILE_TYPES[qtype])
    for t in reader.tensors:
        rows = int(np.prod(t.shape[1:]))
        if len(t.shape) < 2 or t.tensor_type == qtype:  # vectors, and matrices already in qtype
            writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)  # (rows of bytes, as read)
            continue
        w = np.asarray(dequantize(np.array(t.data), t.tensor_type), dtype=np.float32).reshape(rows, int(t.shape[0]))
        if qtype == Q.F32 or (qtype == Q.Q4_K and w.shape[1] % QK_K):
            writer.add_tensor(t.name, w)
        elif qtype == Q.Q4_K:
            writer.add_tensor(t.name, quantize_q4_k(w), raw_dtype=qtype)
        elif qtype == Q.F16:
            writer.add_tensor(t.name, w.astype(np.float16))
        else:
            writer.add_tensor(t.name, quantize(w, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def to_safetensors(src: Path, out_dir: Path) -> Path:
    """``src`` dequantized to float32 (Q/K rows in HF's order) as ``out_dir/model.safetensors`` and
    its config as ``out_dir/config.json``."""
    from safetensors.torch import save_file

    from executor_svc.model.gguf_weights import gguf_tensors
    from pagedserve.gguf_model import GGUFModel

    model = GGUFModel(src)
    out_dir.mkdir(parents=True, exist_ok=True)
    wanted = {e.hf_name for e in model.expected.values()}
    save_file(dict(gguf_tensors(model, wanted)), str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(model.config | {"torch_dtype": "float32"}, indent=1))
    return out_dir


def layer_subset(src: Path, dst: Path, layers: list[int]) -> Path:
    """A self-speculation draft: ``src`` with only the blocks ``layers`` (in that order, renumbered
    0..n-1), its embedding, final norm and LM head; every tensor in its own ggml type (bytes
    copied), metadata as in ``src`` but the block count. Same tokenizer and vocabulary, so it drafts
    for ``src`` (benchmarks/speculative.py). Skipping middle layers keeps far more of the model's
    predictions than cutting the last ones (the final norm and LM head expect a last layer's output)."""
    reader = gguf.GGUFReader(str(src))
    arch = reader.fields["general.architecture"].contents()
    count_key = f"{arch}.block_count"
    total = int(reader.fields[count_key].contents())
    if not layers or len(set(layers)) != len(layers) or not all(0 <= i < total for i in layers):
        raise ValueError(f"layer_subset: distinct layer indices in 0..{total - 1}, got {layers}")
    new_index = {old: new for new, old in enumerate(layers)}
    writer = gguf.GGUFWriter(str(dst), arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        value = len(layers) if field.name == count_key else field.contents()
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    tensors = []
    for t in reader.tensors:
        name = t.name
        if name.startswith("blk."):
            _, index, rest = name.split(".", 2)
            if int(index) not in new_index:
                continue
            name = f"blk.{new_index[int(index)]}.{rest}"
        tensors.append((name, t))
    for name, t in sorted(tensors, key=lambda nt: _order(nt[0])):
        writer.add_tensor(name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def _order(name: str) -> tuple[int, str]:
    """Global tensors first, then blocks by their (new) index."""
    return (int(name.split(".")[1]) + 1, name) if name.startswith("blk.") else (0, name)
