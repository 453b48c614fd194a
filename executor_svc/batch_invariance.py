"""Whether an executor's results are batch-invariant, and what sets its numbers (the handshake's).

A token's logits are batch-invariant when every reduction that produces them runs in an order
that depends only on that token and its context: never on how many rows its step has, which
rows are beside it, how many threads share the work, or which path (fused decode stack, the
modules, a recompute) ran it. On the CPU that is every model packed for the C kernels with the
fused attention backend ("What a seed guarantees", docs/ARCHITECTURE.md): the same code serves
the default and ``--batch-invariant``, so the mode costs nothing there. What cannot promise it
says why, and a scheduler run with ``--batch-invariant`` refuses it (``Handshake.batch_invariant``).

Two executors that both promise it give a request the same bits only when they compute the same
way: the same weight format on the same instruction-set level (a dot product's order follows the
vector width), the same tensor-parallel size. ``numerics`` names that, and such a scheduler
refuses an executor whose numerics differ from those already serving.
"""

from __future__ import annotations

from executor_svc.attention import AttentionBackend
from executor_svc.attention_cpu import FusedCpuAttentionBackend
from executor_svc.model.cpu_layers import CpuRMSNorm
from executor_svc.model.llama import LlamaForCausalLM
from executor_svc.model.weights import PackedLinear


def _cpu_ops(model: LlamaForCausalLM):
    """The C kernels the model's layers call (None: torch computes them)."""
    proj = model.layers[0].self_attn.qkv_proj
    return proj.ops if isinstance(proj, PackedLinear) else None


def batch_variance(model: LlamaForCausalLM, backend: AttentionBackend) -> str | None:
    """Why this executor's results may depend on the rest of their step; None: they cannot."""
    if model.device.type != "cpu":
        return ("a CUDA executor's linear layers run on cuBLAS, which picks its kernel and split by the "
                "row count, and its norms are torch reductions shaped by the step")
    if not isinstance(backend, FusedCpuAttentionBackend):
        return "torch attention (--cpu-attention torch, or the C kernel did not build): SDPA blocks its sums by the query count"
    if _cpu_ops(model) is None or not isinstance(model.norm, CpuRMSNorm):
        return "the CPU kernels are not in use: torch's matrix products and norms block their sums by the row count"
    return None


def numerics(model: LlamaForCausalLM, device: str) -> str:
    """What fixes the bits an executor computes, e.g. ``cpu float32 avx512``, or for a GGUF file's
    mixed layers ``cpu bfloat16 avx512+q4_1 avx512``: executors with equal numerics (and dtype and
    tensor-parallel size, in the handshake too) compute the same bits."""
    ops = _cpu_ops(model)
    if ops is not None and model.weight_format is not None:
        layers = [model.embed_tokens, *([model.lm_head] if model.lm_head is not None else []),
                  *(m for layer in model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                            layer.mlp.gate_up_proj, layer.mlp.down_proj))]
        kernels = sorted({f"{m.fmt} {ops.isa(m.desc().wtype)}" for m in layers if isinstance(m, PackedLinear)})
        return f"{device} {'+'.join(kernels)}"
    if device == "cuda":
        import torch

        return f"cuda {str(model.dtype).removeprefix('torch.')} {torch.cuda.get_device_name(model.device)}"
    return f"{device} {str(model.dtype).removeprefix('torch.')} torch"
