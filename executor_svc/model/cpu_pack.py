"""Prepare a loaded model for the CPU executor: weights in one format, the fused decode path.

Called by the loader for a CPU model, whole or a tensor-parallel rank's shard. Each ``nn.Linear`` becomes a
:class:`~executor_svc.model.weights.PackedLinear` (its float weight converted and freed one
layer at a time, so the peak is the float model plus one layer), or in a block format a
:class:`~executor_svc.model.block_weights.BlockLinear`; layers the loader already built on a
GGUF file's blocks are kept as they are. The embedding becomes a
:class:`~executor_svc.model.weights.PackedEmbedding` that a tied LM head shares, the RMSNorm
weights float32, and when the C kernels load the model gets a
:class:`~executor_svc.model.cpu_decode.DecodeStack` for pure decode steps (unsharded models) and,
for every other step, modules on the same C functions (:mod:`executor_svc.model.cpu_layers`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from executor_svc.cpu_ops import CpuOps
from executor_svc.model.block_weights import BLOCK_FORMATS, BlockEmbedding, BlockLinear
from executor_svc.model.cpu_decode import DecodeStack
from executor_svc.model.cpu_layers import install_cpu_layers
from executor_svc.model.llama import LlamaForCausalLM
from executor_svc.model.weights import FORMATS, PackedEmbedding, PackedLinear, pack_linear

log = logging.getLogger(__name__)
QUANTIZATIONS = ("int8", "gguf")  # int8: Q8_0 blocks of the float weights; gguf: the file's blocks


def weight_format(dtype: torch.dtype, quantization: str | None) -> str:
    """The CPU weight format of ``--dtype`` and ``--quantization`` (for ``gguf``: of the layers the
    file does not store in a block format)."""
    if quantization not in (None, *QUANTIZATIONS):
        raise ValueError(f"quantization: expected one of {QUANTIZATIONS} or none, got {quantization!r}")
    if quantization == "int8":
        return "q8_0"
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
    if dtype not in names:
        raise ValueError(f"dtype: the CPU executor stores weights as float32 or bfloat16, got {dtype}")
    return names[dtype]


def _float32_norms(model: LlamaForCausalLM) -> None:
    norms = [model.norm, *(n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm))]
    for norm in norms:
        norm.weight = nn.Parameter(norm.weight.data.to(torch.float32), requires_grad=False)


def _packed(layer: nn.Module, fmt: str, ops: CpuOps | None) -> PackedLinear:
    if isinstance(layer, PackedLinear):  # (built on a GGUF file's blocks by the loader)
        return layer
    if fmt in BLOCK_FORMATS:
        return BlockLinear.from_float(layer.weight.data, None if layer.bias is None else layer.bias.data, fmt, ops)
    return pack_linear(layer, fmt, ops)


def pack_for_cpu(model: LlamaForCausalLM, fmt: str, ops: CpuOps | None) -> LlamaForCausalLM:
    """``model`` (on the CPU, whole or a rank's shard) with every linear layer in ``fmt``; see the module doc."""
    if fmt not in (*FORMATS, *BLOCK_FORMATS):
        raise ValueError(f"weight format: expected one of {(*FORMATS, *BLOCK_FORMATS)}, got {fmt!r}")
    if model.device.type != "cpu":
        raise ValueError("pack_for_cpu: a model on the CPU only")
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = _packed(attn.qkv_proj, fmt, ops)
        attn.o_proj = _packed(attn.o_proj, fmt, ops)
        mlp.gate_up_proj = _packed(mlp.gate_up_proj, fmt, ops)
        mlp.down_proj = _packed(mlp.down_proj, fmt, ops)
    # A tied table is also the LM head: packed for the kernels. An untied one is only looked up:
    # kept row-major, where a lookup is one plain gather (block formats: packed, looked up in C).
    tied = model.lm_head is None and model.with_lm_head
    if not isinstance(model.embed_tokens, PackedLinear):
        table = model.embed_tokens.weight.data
        model.embed_tokens = BlockEmbedding.from_float(table, None, fmt, ops) if fmt in BLOCK_FORMATS else \
            PackedEmbedding.from_float(table, None, fmt, ops if tied else None)
    if model.lm_head is not None:
        model.lm_head = _packed(model.lm_head, fmt, ops)
    _float32_norms(model)
    layers = [model.embed_tokens, *([model.lm_head] if model.lm_head is not None else []),
              *(m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                        layer.mlp.gate_up_proj, layer.mlp.down_proj))]
    model.weight_format = "+".join(sorted({m.fmt for m in layers}))
    # A tensor-parallel rank sums over ranks inside each layer, which the one-call stack cannot:
    # its decode steps run the modules, on the same C functions.
    model.decode_stack = DecodeStack(model, ops) if ops is not None and model.reduce is None else None
    if ops is not None:  # every step then computes a token as the decode stack does (cpu_layers.py)
        install_cpu_layers(model, ops)
        isas = {m.fmt: ops.isa(m.desc().wtype) for m in layers}
        log.info("CPU weights: %s, kernels on %s (%s)", model.weight_format,
                 ", ".join(f"{f} {i}" for f, i in sorted(isas.items())),
                 ", ".join(k for k, v in ops.features().items() if v) or "no vector extensions")
    return model
