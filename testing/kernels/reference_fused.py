"""float64 references for the fused decoder-layer kernels, written from the definitions (RMSNorm,
SiLU, rotary embedding), sharing no code with the kernels or the model's torch modules."""

from __future__ import annotations

import torch


def ref_add_rms_norm(residual: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(new residual, normed output) in float64."""
    x = residual.double() if delta is None else residual.double() + delta.double()
    normed = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x, normed * weight.double()


def ref_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.double().chunk(2, dim=-1)
    return gate * torch.sigmoid(gate) * up


def ref_rotary(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """x [n, heads, head] rotated pairwise (i, i + head/2) by angle position * inv_freq[i]. The angle
    is the float32 product, as transformers computes it (at position 4095 its rounding alone moves
    float32 outputs by more than their own precision); everything after it is float64."""
    angle = (positions.float()[:, None] * inv_freq.float()[None, :]).double()  # [n, head/2]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x.double()[..., :half], x.double()[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
