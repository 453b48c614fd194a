"""A GGUF file's tensors as the HF checkpoint's: dequantized, renamed, Q/K rows un-permuted.

On the CPU (``--quantization gguf``, the default for a GGUF file with ``--dtype auto``) a linear
layer whose tensors are all Q8_0, all Q4_0, all Q4_1 or all Q4_K keeps them as stored (:func:`gguf_blocks`:
the bytes, rows in HF's order) and computes on them (``block_weights.py``). Every other tensor,
and every tensor with ``--dtype float32``/``bfloat16``, is dequantized at load with
``gguf.quants.dequantize`` (llama.cpp's own reference, numpy) to float32, then copied into the
model in the executor's ``--dtype``. That is also the CUDA path: there are no CUDA kernels that
compute on the blocks, so a quantized file takes its dequantized size in GPU memory. Q5_0, Q5_1,
Q5_K and Q6_K are dequantized on the CPU too: no kernel computes on them yet.

llama.cpp's converter permutes the rows of a llama ``q_proj``/``k_proj`` (weights and biases) from
HF's rotate-half RoPE layout to its interleaved one; :func:`unpermute` reverses that, as
transformers' GGUF loader does. Qwen2 files are not permuted.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from pagedserve.gguf_model import GGUFModel


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``: rows of each head go from (dim/2, 2) pairs back to two halves."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _unpermuted(model: GGUFModel, name: str, rows: np.ndarray) -> np.ndarray:
    if model.arch == "llama" and (".attn_q." in name or ".attn_k." in name):
        c = model.config
        return unpermute(rows, c["num_attention_heads"] if ".attn_q." in name else c["num_key_value_heads"])
    return rows


def hf_types(model: GGUFModel) -> dict[str, Q]:
    """HF tensor name -> the ggml type the file stores it in."""
    return {exp.hf_name: model.file.tensors[name].ggml_type for name, exp in model.expected.items()}


def gguf_blocks(model: GGUFModel, wanted: set[str]) -> Iterator[tuple[str, np.ndarray, Q]]:
    """(HF name, stored rows [rows, row bytes] uint8, ggml type) of every wanted tensor, rows in
    HF's order (a permutation of whole rows: the blocks run along a row)."""
    for name, exp in model.expected.items():
        if exp.hf_name in wanted:
            info = model.file.tensors[name]
            yield exp.hf_name, _unpermuted(model, name, model.file.raw(name)), info.ggml_type


def gguf_tensors(model: GGUFModel, wanted: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) of every tensor whose HF name is in ``wanted``, one at a time
    (peak memory: the model plus one dequantized tensor)."""
    for name, exp in model.expected.items():
        if exp.hf_name not in wanted:
            continue
        info = model.file.tensors[name]
        w = np.asarray(dequantize(model.file.raw(name), info.ggml_type), dtype=np.float32).reshape(info.shape)
        w = _unpermuted(model, name, w)
        yield exp.hf_name, torch.from_numpy(np.require(w, requirements=["C", "W"]))  # (F32: a copy of the map)
