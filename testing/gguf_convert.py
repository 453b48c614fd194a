"""A GGUF file's weights written again in another ggml type, or as a float32 safetensors
checkpoint: the same model, other bytes.

``convert(src, dst, qtype)`` dequantizes every matrix of ``src`` (``gguf.quants``) and stores it
as ``qtype`` (F32, F16, BF16, or a format ``gguf.quants.quantize`` writes: Q8_0, Q4_0, Q4_1),
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

# llama.cpp's LLAMA_FTYPE of a file whose matrices are all of one type
FILE_TYPES = {Q.F32: 0, Q.F16: 1, Q.Q4_0: 2, Q.Q4_1: 3, Q.Q8_0: 7, Q.BF16: 32}


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
        if qtype == Q.F32:
            writer.add_tensor(t.name, w)
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
