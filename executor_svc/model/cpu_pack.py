"""Prepare a loaded model for the CPU executor: weights in one format, the fused decode path.

Called by the loader for a CPU model, whole or a tensor-parallel rank's shard. Each ``nn.Linear`` becomes a
:class:`~executor_svc.model.weights.PackedLinear` (its float weight converted and freed one
layer at a time, so the peak is the float model plus one layer), the embedding a
:class:`~executor_svc.model.weights.PackedEmbedding` that a tied LM head shares, the RMSNorm
weights float32, and when the C kernels load the model gets a
:class:`~executor_svc.model.cpu_decode.DecodeStack` for pure decode steps (unsharded models) and,
for every other step, modules on the same C functions (:mod:`executor_svc.model.cpu_layers`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from executor_svc.cpu_ops import W_BF16, W_F32, W_Q8, CpuOps
from executor_svc.model.cpu_decode import DecodeStack
from executor_svc.model.cpu_layers import install_cpu_layers
from executor_svc.model.llama import LlamaForCausalLM
from executor_svc.model.weights import FORMATS, PackedEmbedding, pack_linear

log = logging.getLogger(__name__)
_WTYPES = {"float32": W_F32, "bfloat16": W_BF16, "int8": W_Q8}


def weight_format(dtype: torch.dtype, quantization: str | None) -> str:
    """The CPU weight format of ``--dtype`` and ``--quantization``."""
    if quantization is not None:
        if quantization not in ("int8",):
            raise ValueError(f"quantization: expected 'int8' or none, got {quantization!r}")
        return quantization
    names = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
    if dtype not in names:
        raise ValueError(f"dtype: the CPU executor stores weights as float32 or bfloat16, got {dtype}")
    return names[dtype]


def _float32_norms(model: LlamaForCausalLM) -> None:
    norms = [model.norm, *(n for layer in model.layers for n in (layer.input_layernorm, layer.post_attention_layernorm))]
    for norm in norms:
        norm.weight = nn.Parameter(norm.weight.data.to(torch.float32), requires_grad=False)


def pack_for_cpu(model: LlamaForCausalLM, fmt: str, ops: CpuOps | None) -> LlamaForCausalLM:
    """``model`` (on the CPU) with every linear layer in ``fmt``; see the module doc."""
    if fmt not in FORMATS:
        raise ValueError(f"weight format: expected one of {FORMATS}, got {fmt!r}")
    if model.device.type != "cpu":
        raise ValueError("pack_for_cpu: a model on the CPU only")
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.qkv_proj = pack_linear(attn.qkv_proj, fmt, ops)
        attn.o_proj = pack_linear(attn.o_proj, fmt, ops)
        mlp.gate_up_proj = pack_linear(mlp.gate_up_proj, fmt, ops)
        mlp.down_proj = pack_linear(mlp.down_proj, fmt, ops)
    # A tied table is also the LM head: packed for the kernels. An untied one is only looked up:
    # kept row-major, where a lookup is one plain gather.
    tied = model.lm_head is None and model.with_lm_head
    model.embed_tokens = PackedEmbedding.from_float(model.embed_tokens.weight.data, None, fmt, ops if tied else None)
    if model.lm_head is not None:
        model.lm_head = pack_linear(model.lm_head, fmt, ops)
    _float32_norms(model)
    model.weight_format = fmt
    # A tensor-parallel rank sums over ranks inside each layer, which the one-call stack cannot:
    # its decode steps run the modules, on the same C functions.
    model.decode_stack = DecodeStack(model, ops) if ops is not None and model.reduce is None else None
    if ops is not None:  # every step then computes a token as the decode stack does (cpu_layers.py)
        install_cpu_layers(model, ops)
    if ops is not None:
        log.info("CPU weights: %s, kernels on %s (%s)", fmt, ops.isa(_WTYPES[fmt]),
                 ", ".join(k for k, v in ops.features().items() if v) or "no vector extensions")
    return model
