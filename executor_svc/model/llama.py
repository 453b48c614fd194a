"""Our own Llama-family transformer (Llama, Mistral, Qwen2) over packed tokens.

A step is one flat sequence of tokens from many sequences (no padding); the
attention backend uses :class:`AttentionMetadata` to keep sequences apart and
to read/write the paged KV cache. q/k/v and gate/up projections are fused
into one matmul each (the loader concatenates the HF weights).

Tensor parallelism (executor_svc/parallel/shard.py): built from a rank's local
config, the modules hold that rank's heads and MLP columns; ``reduce`` (an
in-place sum over ranks) completes the row-parallel ``o_proj`` and
``down_proj``, whose replicated bias is added once, after the sum.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from executor_svc.attention import AttentionBackend, AttentionMetadata, KVCaches
from executor_svc.model.architecture import ModelConfig
from executor_svc.model.rope import RotaryEmbedding, apply_rotary
from executor_svc.model.weights import PackedLinear


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 and cast back before the weight, as HF Llama does.
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


AllReduce = Callable[[torch.Tensor], torch.Tensor]  # sum over the tensor-parallel ranks


def _linear(n_in: int, n_out: int, bias: bool) -> nn.Linear:
    layer = nn.Linear(n_in, n_out, bias=bias, device="meta")
    layer.requires_grad_(False)
    return layer


def _row_parallel(layer: nn.Linear, x: torch.Tensor, reduce: AllReduce | None) -> torch.Tensor:
    """``layer(x)`` where x [n, in // N] and the weight hold this rank's input features: partial
    products summed over ranks, then the (replicated) bias once."""
    if reduce is None:
        return layer(x)
    y = F.linear(x, layer.weight)  # [n, out] this rank's partial product
    add_lora = getattr(layer, "add_lora", None)  # a LoRA wrapper (executor_svc/lora/apply.py)
    if add_lora is not None:
        y = add_lora(x, y)  # (x holds this rank's input columns, the adapter's A likewise: a partial delta)
    y = reduce(y)  # complete after the sum
    return y if layer.bias is None else y + layer.bias


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, reduce: AllReduce | None = None) -> None:
        super().__init__()
        self.reduce = reduce
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = _linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, cfg.qkv_bias)
        self.o_proj = _linear(self.q_size, cfg.hidden_size, cfg.o_bias)
        self.scale = cfg.head_dim ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                backend: AttentionBackend) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rotary(q.view(n, self.num_heads, self.head_dim), cos, sin)
        k = apply_rotary(k.view(n, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        backend.write_kv(k, v, cache[0], cache[1], meta)
        o = backend.forward(q, cache[0], cache[1], meta, self.scale)
        return _row_parallel(self.o_proj, o.reshape(n, self.q_size), self.reduce)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, reduce: AllReduce | None = None) -> None:
        super().__init__()
        self.reduce = reduce
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = _linear(cfg.hidden_size, 2 * cfg.intermediate_size, False)
        self.down_proj = _linear(cfg.intermediate_size, cfg.hidden_size, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)
        return _row_parallel(self.down_proj, F.silu(gate) * up, self.reduce)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, reduce: AllReduce | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, reduce)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, reduce)

    def forward(self, x, cos, sin, cache, meta, backend) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, cache, meta, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    """Parameters are created on the meta device; the loader materialises them.

    ``reduce`` and ``with_lm_head`` serve tensor parallelism: a rank's local config, the sum over
    ranks, and whether this rank computes logits (only the sampling rank does)."""

    def __init__(self, cfg: ModelConfig, reduce: AllReduce | None = None, with_lm_head: bool = True) -> None:
        super().__init__()
        self.cfg = cfg
        # Given its (meta) weight, Embedding skips its random init: normal_ on a meta tensor goes through
        # torch's Python references, whose first use imports torch._dynamo (~1.6 s of every start).
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size,
                                         _weight=torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta"))
        self.embed_tokens.requires_grad_(False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, reduce) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.with_lm_head = with_lm_head
        untied = with_lm_head and not cfg.tie_word_embeddings
        self.lm_head = _linear(cfg.hidden_size, cfg.vocab_size, False) if untied else None
        self.rotary: RotaryEmbedding | None = None  # built by the loader on the target device
        self.reduce = reduce
        # Set by cpu_pack.pack_for_cpu: the linear layers' weight format, and the fused C path of
        # pure decode steps (executor_svc/model/cpu_decode.py; None: every step runs the modules).
        self.weight_format: str | None = None
        self.decode_stack = None
        # Set by executor_svc/lora (LoraState): while its ``batch`` is set the step holds adapter tokens,
        # whose deltas only the (wrapped) modules add, so such a step never takes the decode stack.
        self.lora = None
        # Set by cuda_layers.install (CUDA, unless --no-fused-layers): the layers on the fused kernels,
        # taken with a backend that lets the model write K/V itself (``fused_kv_write``).
        self.fused_layers = None

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (a CPU-packed model keeps them float32 whatever its weights)."""
        return self.norm.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: KVCaches,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions [num_tokens] int64 -> final hidden states [num_tokens, hidden]."""
        return self.forward_with_logits(input_ids, positions, caches, meta, backend)[0]

    def forward_with_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: KVCaches,
                            meta: AttentionMetadata, backend: AttentionBackend, every_row_scored: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`forward`, and every row's logits [num_tokens, vocab] float32 when the step computed
        them on its way (the fused decode stack runs the LM head in its C call); else None, and
        :meth:`compute_logits` computes the rows wanted. ``every_row_scored``: the caller wants
        every row's logits (a speculative verification), so the decode stack, which computes them
        all, runs the step even where sequences add several tokens."""
        if self.rotary is None:
            raise RuntimeError("model used before load_model() built its rotary embedding")
        x = self.embed_tokens(input_ids)
        if (self.decode_stack is not None and backend.runs_decode_stack
                and (meta.max_query_len == 1 or every_row_scored)):
            return self.decode_stack(x, positions, caches, meta, self.lora.batch if self.lora is not None else None)
        if self.fused_layers is not None and backend.fused_kv_write:
            return self.fused_layers.forward(self, x, positions, caches, meta, backend), None
        cos, sin = self.rotary.cos_sin(positions, x.dtype)
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, cos, sin, cache, meta, backend)
        return self.norm(x), None

    def logits_head(self) -> PackedLinear | None:
        """The LM head of a CPU-packed model (a tied one is the embedding's table); else None."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return head if isinstance(head, PackedLinear) and self.with_lm_head else None

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] float32; into ``out`` when given (a CUDA graph's
        one logits buffer: the cast to float32 writes there, no copy more)."""
        if not self.with_lm_head:
            raise RuntimeError("compute_logits on a tensor-parallel rank without the LM head (rank 0 samples)")
        head = self.logits_head()
        if head is not None:
            logits = head.project(hidden)
            return logits if out is None else out.copy_(logits)
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(hidden, weight)
        return logits.to(torch.float32) if out is None else out.copy_(logits)
