"""A GGUF file's tensors as the HF checkpoint's: dequantized, renamed, Q/K rows un-permuted.

Every block format is dequantized at load with ``gguf.quants.dequantize`` (llama.cpp's own
reference, numpy) to float32, then copied into the model in the executor's ``--dtype``. That is
also the CUDA path: there are no kernels yet that compute on Q8_0/Q4 blocks directly, so a
quantized file takes its dequantized size in memory.

llama.cpp's converter permutes the rows of a llama ``q_proj``/``k_proj`` (weights and biases) from
HF's rotate-half RoPE layout to its interleaved one; :func:`unpermute` reverses that, as
transformers' GGUF loader does. Qwen2 files are not permuted.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from gguf.quants import dequantize

from pagedserve.gguf_model import GGUFModel


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's ``permute``: rows of each head go from (dim/2, 2) pairs back to two halves."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model: GGUFModel, wanted: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, float32 tensor) of every tensor whose HF name is in ``wanted``, one at a time
    (peak memory: the model plus one dequantized tensor)."""
    c = model.config
    for name, exp in model.expected.items():
        if exp.hf_name not in wanted:
            continue
        info = model.file.tensors[name]
        w = np.asarray(dequantize(model.file.raw(name), info.ggml_type), dtype=np.float32).reshape(info.shape)
        if model.arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            w = unpermute(w, c["num_attention_heads"] if ".attn_q." in name else c["num_key_value_heads"])
        yield exp.hf_name, torch.from_numpy(np.require(w, requirements=["C", "W"]))  # (F32: a copy of the map)
