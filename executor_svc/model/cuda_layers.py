"""The CUDA decoder layers: the model's forward on the fused elementwise kernels.

On CUDA the eager modules (llama.py) spend most of a layer's launches on small torch ops: RMSNorm is
six to eight of them, RoPE five per tensor, SiLU-and-mul two, every residual add one, plus the
backend's separate KV-cache write. :class:`FusedLayers` runs the same layer with three kernels
(``cupy_kernels/fused_layers.cu``) between the projections and the attention:

* ``add_rms_norm``: the previous sub-layer's output added to the residual stream in place, and the
  next norm of it, in one pass ("fused_add_rms_norm"); the stream stays in one buffer for the whole
  forward, so the model's ``x = x + f(x)`` costs no launch of its own.
* ``rope_and_cache``: q and k rotated in place inside the merged qkv projection's output, and the
  token's K and V written to its cache slot by the same launch. The backend's ``write_kv`` is then
  skipped: only a backend whose caches are the contract's layout and whose ``write_kv`` does nothing
  else (``AttentionBackend.fused_kv_write``) is run this way.
* ``silu_and_mul`` over the merged gate/up projection's output.

The projections are the model's own modules, called as the eager path calls them, so what wraps
them composes unchanged: a LoRA delta (executor_svc/lora/apply.py) is inside ``qkv_proj(x)``, added
before RoPE as in the eager path; tensor parallelism's row-parallel sum and bias stay in
``_row_parallel``. The kernels round every intermediate as the eager ops do (see the .cu header).

Batch invariance: each kernel handles one token row per thread block and reduces it in an order set
by the hidden size alone, never by the number of rows, so a row's bits do not depend on its step
(tests/unit/kernels/test_cuda_fused_model.py shows it); the mode need not turn them off.

No host synchronisation anywhere (shapes are host values, no ``.item()``): decode steps stay
capturable as CUDA graphs (executor_svc/decode_graphs.py).
"""

from __future__ import annotations

import torch

from executor_svc.attention import AttentionBackend, AttentionMetadata, KVCaches
from executor_svc.model.llama import _row_parallel


def cuda_kernels():
    """The CuPy launchers (imported only on CUDA: CuPy exists only on GPU machines)."""
    from cupy_kernels import fused_layers

    return fused_layers


class FusedLayers:
    """The decoder layers of one model on the fused kernels. ``kernels``: an object with the
    launchers' ``add_rms_norm``, ``silu_and_mul`` and ``rope_and_cache`` (cupy_kernels.fused_layers
    on CUDA; the SIMT emulator in tests), each called with its output given."""

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    def forward(self, model, x: torch.Tensor, positions: torch.Tensor, caches: KVCaches,
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """The model's layers and final norm over embeddings ``x`` [n, hidden] (taken as the residual
        stream and updated in place) -> the final hidden states [n, hidden]."""
        inv_freq = model.rotary.inv_freq
        residual, delta = x, None  # the stream, and the sub-layer output not yet added to it
        for layer, (k_cache, v_cache) in zip(model.layers, caches, strict=True):
            h = self._norm(residual, delta, layer.input_layernorm)
            delta = self._attention(layer.self_attn, h, positions, inv_freq, k_cache, v_cache, meta, backend)
            h = self._norm(residual, delta, layer.post_attention_layernorm, out=delta)  # (delta is spent)
            delta = self._mlp(layer.mlp, h)
        return self._norm(residual, delta, model.norm)

    def _norm(self, residual: torch.Tensor, delta: torch.Tensor | None, norm,
              out: torch.Tensor | None = None) -> torch.Tensor:
        out = torch.empty_like(residual) if out is None else out
        self.kernels.add_rms_norm(residual, delta, norm.weight, norm.eps, out)
        return out

    def _attention(self, attn, h: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                   backend: AttentionBackend) -> torch.Tensor:
        n, head = h.shape[0], attn.head_dim
        qkv = attn.qkv_proj(h)  # [n, q_size + 2 * kv_size], any LoRA delta included (before RoPE)
        q = qkv[:, :attn.q_size].view(n, attn.num_heads, head)  # views of the rows: rotated in place
        k = qkv[:, attn.q_size:attn.q_size + attn.kv_size].view(n, attn.num_kv_heads, head)
        v = qkv[:, attn.q_size + attn.kv_size:].view(n, attn.num_kv_heads, head)
        self.kernels.rope_and_cache(q, k, v, k_cache, v_cache, positions, meta.slot_mapping, inv_freq)
        o = backend.forward(q, k_cache, v_cache, meta, attn.scale)
        return _row_parallel(attn.o_proj, o.reshape(n, attn.q_size), attn.reduce)

    def _mlp(self, mlp, h: torch.Tensor) -> torch.Tensor:
        gate_up = mlp.gate_up_proj(h)  # [n, 2 * intermediate]
        act = torch.empty(gate_up.shape[0], mlp.intermediate, dtype=gate_up.dtype, device=gate_up.device)
        self.kernels.silu_and_mul(gate_up, act)
        return _row_parallel(mlp.down_proj, act, mlp.reduce)


def install(model, enabled: bool = True, kernels=None) -> FusedLayers | None:
    """The one place that decides whether ``model`` runs its layers on the fused kernels: a CUDA
    model, unless ``enabled`` is False (``--no-fused-layers``); ``kernels`` given (tests: the
    emulator), any model. Sets and returns ``model.fused_layers`` (None: the eager modules)."""
    use = enabled and (kernels is not None or model.device.type == "cuda")
    model.fused_layers = FusedLayers(kernels if kernels is not None else cuda_kernels()) if use else None
    return model.fused_layers
