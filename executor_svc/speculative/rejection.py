"""Verify proposed tokens against the target model's distributions at the k + 1 scored positions.

One forward scores the last accepted token plus k proposals, giving the target's (already
penalised, masked, tempered and truncated) distribution at each of the k + 1 positions. The
proposals are walked in order; the first one rejected is replaced by a token drawn so that the
emitted sequence has exactly the target's distribution (Leviathan et al. 2023; Chen et al. 2023).
If all k are accepted, position k + 1 gives one more token for free (the "bonus").

The n-gram proposer's proposal is a point mass q = delta(x): accept x with probability
min(1, p(x) / q(x)) = p(x); on rejection draw from (p - q)+ renormalised, which is p with x removed.
Greedy rows need no randomness: accept while the proposal is the target's argmax.

Randomness comes from the caller as one uniform per position for acceptance and one for the
draw, so a seeded request derives both from (seed, output position) and is reproducible in any
batch, exactly like the plain sampler.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from executor_svc.sampler import seeded_uniform

_ACCEPT_SALT = 0x5EC0DEC0FFEE  # keeps the acceptance draws independent of the token draws


def verify_greedy(proposals: Sequence[int], target_argmax: Sequence[int]) -> list[int]:
    """Accepted proposals then the target's own token at the first mismatch (or the bonus).

    ``target_argmax[i]`` is the target's greedy token after the prefix plus ``proposals[:i]``;
    the result is exactly what plain greedy decoding would emit, 1..k+1 tokens long.
    """
    if len(target_argmax) != len(proposals) + 1:
        raise ValueError(f"target_argmax: need {len(proposals) + 1} positions, got {len(target_argmax)}")
    out: list[int] = []
    for proposed, target in zip(proposals, target_argmax, strict=False):  # (the bonus row is extra)
        out.append(int(target))
        if proposed != target:
            return out
    out.append(int(target_argmax[-1]))
    return out


def verify_point_mass(proposals: Sequence[int], probs: torch.Tensor,
                      accept_uniforms: Sequence[float], draw_uniforms: Sequence[float]) -> list[int]:
    """Rejection sampling for point-mass proposals; ``probs`` is [k + 1, vocab], rows summing to 1.

    Returns the accepted proposals then one drawn token: the residual draw at the first rejection,
    or the bonus from the last row when all are accepted.
    """
    k = len(proposals)
    if probs.dim() != 2 or probs.shape[0] != k + 1:
        raise ValueError(f"probs: need shape [{k + 1}, vocab], got {list(probs.shape)}")
    if len(accept_uniforms) < k or len(draw_uniforms) < k + 1:
        raise ValueError(f"uniforms: need {k} acceptance and {k + 1} draw numbers")
    out: list[int] = []
    for i, x in enumerate(proposals):
        row = probs[i].to(torch.float64)
        if accept_uniforms[i] < float(row[x]):
            out.append(int(x))
            continue
        residual = row.clone()
        residual[x] = 0.0  # (p - delta_x)+ : x itself can never be the correction
        out.append(_draw(residual, draw_uniforms[i]))
        return out
    out.append(_draw(probs[k].to(torch.float64), draw_uniforms[k]))
    return out


def seeded_uniforms(seed: int, first_position: int, count: int) -> tuple[list[float], list[float]]:
    """(acceptance, draw) uniforms for output positions first_position.. of a seeded request."""
    positions = range(first_position, first_position + count)
    return ([seeded_uniform(seed ^ _ACCEPT_SALT, j) for j in positions],
            [seeded_uniform(seed, j) for j in positions])


def _draw(row: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw from an unnormalised row of probabilities."""
    cdf = torch.cumsum(row, dim=0)
    if float(cdf[-1]) <= 0.0:
        raise ValueError("probs: a row with no mass left to draw from")
    idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=cdf.dtype), right=True)[0])
    return min(idx, row.shape[0] - 1)
