"""Rotary position embeddings (the "rotate half" / NeoX form HF Llama uses).

Inverse frequencies are computed exactly as transformers does (float32), so
positions rotate bit-for-bit like the reference; cos/sin are computed per step
for the packed positions instead of from a cache, which keeps memory flat for
long contexts and costs little next to the matmuls.
"""

from __future__ import annotations

import math

import torch

from executor_svc.model.architecture import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """[head_dim // 2] float32."""
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).to(dtype=torch.float) / head_dim
    inv_freq = 1.0 / (rope.theta ** exponent)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3(inv_freq, rope)
    return inv_freq


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    """Llama 3.1 frequency-dependent scaling: long wavelengths divided by
    ``factor``, short ones kept, the band between interpolated smoothly."""
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    def __init__(self, rope: RopeConfig, head_dim: int, device: torch.device) -> None:
        self.inv_freq = inverse_frequencies(rope, head_dim).to(device)  # [head_dim // 2] float32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] int64 -> cos, sin [num_tokens, 1, head_dim] in ``dtype``."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [num_tokens, num_heads, head_dim]; cos/sin broadcast over heads."""
    return x * cos + _rotate_half(x) * sin
