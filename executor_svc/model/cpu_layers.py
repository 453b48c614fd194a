"""The per-operator path of a CPU-packed model, on the fused decode stack's own C functions.

A pure decode step runs the whole stack in C (``cpu_decode.py``); every other step (prefill,
chunked prefill, a prefill with decode neighbours) runs the torch modules. With torch's
RMSNorm, rotary and SiLU those two paths round differently, and torch's reductions block
differently by how many rows a step has: a token's logprobs then moved in their last bits with
a prefix cache hit, a chunk size or a preemption. These modules replace them in a packed model
with ``csrc/rowwise_cpu.c``, the functions the decode stack calls: each row is computed on its
own, in one order. With the linear layers on the C kernel at every row count
(``weights.py``) and attention on the paged kernel for every row (``attention_cpu.py``), a
token's activations depend only on its own context ("What a seed guarantees",
docs/ARCHITECTURE.md). A tensor-parallel rank's shard runs these modules for every step, decode
included, its row-parallel sums over ranks in rank order.
"""

from __future__ import annotations

import torch

from executor_svc.attention import AttentionBackend, AttentionMetadata
from executor_svc.cpu_ops import CpuOps
from executor_svc.model.architecture import ModelConfig
from executor_svc.model.llama import MLP, Attention, LlamaForCausalLM, RMSNorm
from executor_svc.model.rope import RotaryEmbedding


class CpuRMSNorm(RMSNorm):
    def __init__(self, norm: RMSNorm, ops: CpuOps) -> None:
        super().__init__(norm.weight.shape[0], norm.eps)
        self.weight, self.ops = norm.weight, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, self.eps)


class CpuRotary(RotaryEmbedding):
    """cos/sin as the C rotation takes them: [num_tokens, head_dim / 2] float32 tables."""

    def __init__(self, rotary: RotaryEmbedding, ops: CpuOps) -> None:
        self.inv_freq, self.ops = rotary.inv_freq, ops

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.rope_tables(positions, self.inv_freq)


def _sum_over_ranks(y: torch.Tensor, reduce, bias: torch.Tensor | None) -> torch.Tensor:
    """A row-parallel layer's output: this rank's partial product summed over the ranks (in rank
    order, ``TPGroup.all_reduce``), then the bias once; unsharded, ``y`` holds its bias already."""
    y = reduce(y) if reduce is not None else y
    return y if bias is None else y + bias


class CpuAttention(Attention):
    def __init__(self, cfg: ModelConfig, attn: Attention, ops: CpuOps) -> None:
        super().__init__(cfg, attn.reduce)
        self.qkv_proj, self.o_proj, self.ops = attn.qkv_proj, attn.o_proj, ops
        self.o_bias = self.o_proj.take_bias() if self.reduce is not None else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        n = x.shape[0]
        qkv = self.qkv_proj(x)  # [n, q + 2 kv], rows contiguous: q heads then k heads rotate in place
        self.ops.rope(qkv, self.num_heads + self.num_kv_heads, self.head_dim, cos, sin)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        backend.write_kv(k, v.view(n, self.num_kv_heads, self.head_dim), cache[0], cache[1], meta)
        o = backend.forward(q.view(n, self.num_heads, self.head_dim), cache[0], cache[1], meta, self.scale)
        return _sum_over_ranks(self.o_proj(o.reshape(n, self.q_size)), self.reduce, self.o_bias)


class CpuMLP(MLP):
    def __init__(self, cfg: ModelConfig, mlp: MLP, ops: CpuOps) -> None:
        super().__init__(cfg, mlp.reduce)
        self.gate_up_proj, self.down_proj, self.ops = mlp.gate_up_proj, mlp.down_proj, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _sum_over_ranks(self.down_proj(self.ops.silu_mul(self.gate_up_proj(x))), self.reduce, None)


def install_cpu_layers(model: LlamaForCausalLM, ops: CpuOps) -> None:
    """Swap the norms, rotary, attention and MLP modules of a packed model (weights shared)."""
    if model.rotary is None:
        raise RuntimeError("install_cpu_layers: the model's rotary embedding is not built yet")
    cfg = model.cfg
    for layer in model.layers:
        layer.input_layernorm = CpuRMSNorm(layer.input_layernorm, ops)
        layer.post_attention_layernorm = CpuRMSNorm(layer.post_attention_layernorm, ops)
        layer.self_attn = CpuAttention(cfg, layer.self_attn, ops)
        layer.mlp = CpuMLP(cfg, layer.mlp, ops)
    model.norm = CpuRMSNorm(model.norm, ops)
    model.rotary = CpuRotary(model.rotary, ops)
