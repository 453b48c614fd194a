"""Seeded synthetic request traces with the vLLM paper's length statistics.

The paper (§6.1, Fig. 11) samples requests from two datasets we cannot ship:

* ShareGPT: mean input 161.31 tokens, mean output 337.99 tokens, long right tails.
* Alpaca:   mean input  19.31 tokens, mean output  58.45 tokens.

We draw both lengths from log-normal distributions whose ``mu`` is calibrated
(once, deterministically) so that the mean *after* the model-length limits
(prompt <= 1024, prompt + output <= 2048, as for OPT's 2048-token context)
matches the paper's mean. ``sigma`` sets the skew; ShareGPT gets a wide one
because its real lengths span 1..2000, Alpaca a narrow one (short
instructions). Arrivals are a Poisson process (exponential gaps), as in §6.1.

A trace is a list of :class:`TraceRequest`; prompt token ids are random (seeded)
so that prefix caching only hits where a trace shares prefixes on purpose
(:func:`shared_prefix_trace`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

OPT_VOCAB_SIZE = 50272
_FIRST_TOKEN_ID = 4  # OPT's ids 0..3 are special (pad, bos/eos); prompts avoid them
_CALIBRATION_DRAWS = 200_000


@dataclass(frozen=True, slots=True)
class LengthDist:
    """Target statistics of a dataset's (input, output) token lengths."""

    name: str
    input_mean: float
    output_mean: float
    input_sigma: float  # log-normal shape of the input length
    output_sigma: float  # log-normal shape of the output length
    max_prompt: int = 1024
    max_total: int = 2048


SHAREGPT = LengthDist("sharegpt", input_mean=161.31, output_mean=337.99, input_sigma=1.1, output_sigma=1.1)
ALPACA = LengthDist("alpaca", input_mean=19.31, output_mean=58.45, input_sigma=0.6, output_sigma=0.7)
DISTS = {d.name: d for d in (SHAREGPT, ALPACA)}


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request of a trace: when it arrives, its prompt, how many tokens it generates."""

    request_id: str
    arrival_time: float  # seconds since the start of the trace
    prompt_token_ids: tuple[int, ...]
    output_len: int  # the generation stops after exactly this many tokens
    prefix_id: int = -1  # which shared prefix the prompt starts with (-1: none)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _clipped_lengths(mu: float, sigma: float, z: np.ndarray, upper: np.ndarray | int) -> np.ndarray:
    """Integer lengths exp(mu + sigma z), rounded, clipped into [1, upper]."""
    raw = np.rint(np.exp(mu + sigma * z))
    return np.clip(raw, 1, upper).astype(np.int64)


def _solve_mu(target: float, sigma: float, z: np.ndarray, upper: np.ndarray | int) -> float:
    """Bisection on mu so the clipped lengths' mean hits ``target`` (monotone in mu)."""
    lo, hi = -5.0, 12.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if _clipped_lengths(mid, sigma, z, upper).mean() < target:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


@functools.lru_cache(maxsize=16)
def calibrated_mus(dist: LengthDist) -> tuple[float, float]:
    """(mu_input, mu_output) for ``dist``; computed on fixed normal draws, hence deterministic."""
    rng = np.random.default_rng(12345)
    z_in = rng.standard_normal(_CALIBRATION_DRAWS)
    z_out = rng.standard_normal(_CALIBRATION_DRAWS)
    mu_in = _solve_mu(dist.input_mean, dist.input_sigma, z_in, dist.max_prompt)
    prompts = _clipped_lengths(mu_in, dist.input_sigma, z_in, dist.max_prompt)
    mu_out = _solve_mu(dist.output_mean, dist.output_sigma, z_out, dist.max_total - prompts)
    return mu_in, mu_out


def sample_lengths(dist: LengthDist, num: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(prompt_lens, output_lens), each ``[num] int64``, within the dataset's limits."""
    if num < 0:
        raise ValueError(f"num must be >= 0, got {num}")
    mu_in, mu_out = calibrated_mus(dist)
    prompts = _clipped_lengths(mu_in, dist.input_sigma, rng.standard_normal(num), dist.max_prompt)
    outputs = _clipped_lengths(mu_out, dist.output_sigma, rng.standard_normal(num), dist.max_total - prompts)
    return prompts, outputs


def poisson_arrivals(rate: float, num: int, rng: np.random.Generator) -> np.ndarray:
    """Arrival times ``[num] float64`` of a Poisson process with ``rate`` requests/s (first gap included)."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    return np.cumsum(rng.exponential(1.0 / rate, size=num))


def _random_tokens(rng: np.random.Generator, n: int, vocab_size: int) -> tuple[int, ...]:
    return tuple(rng.integers(_FIRST_TOKEN_ID, vocab_size, size=n).tolist())


def synthetic_trace(dist: LengthDist | str, num_requests: int, rate: float, seed: int = 0,
                    vocab_size: int = OPT_VOCAB_SIZE) -> list[TraceRequest]:
    """``num_requests`` requests with ``dist``'s lengths arriving as Poisson(``rate``)."""
    dist = DISTS[dist] if isinstance(dist, str) else dist
    rng = np.random.default_rng(seed)
    prompts, outputs = sample_lengths(dist, num_requests, rng)
    arrivals = poisson_arrivals(rate, num_requests, rng)
    return [
        TraceRequest(f"{dist.name}-{seed}-{i}", float(arrivals[i]),
                     _random_tokens(rng, int(prompts[i]), vocab_size), int(outputs[i]))
        for i in range(num_requests)
    ]


def shared_prefix_trace(num_requests: int, rate: float, seed: int = 0, num_prefixes: int = 4,
                        prefix_len: int = 512, suffix_dist: LengthDist = ALPACA,
                        vocab_size: int = OPT_VOCAB_SIZE) -> list[TraceRequest]:
    """Requests whose prompts start with one of ``num_prefixes`` long shared prefixes.

    Models a few long system prompts / few-shot examples (paper §4.4, Fig. 10)
    followed by a short request-specific part drawn from ``suffix_dist``. The
    prefix is chosen uniformly; prompts are cut to ``suffix_dist.max_prompt``.
    """
    if num_prefixes < 1 or prefix_len < 1:
        raise ValueError(f"num_prefixes and prefix_len must be >= 1, got {num_prefixes}, {prefix_len}")
    if prefix_len >= suffix_dist.max_prompt:
        raise ValueError(f"prefix_len must be < max_prompt={suffix_dist.max_prompt}, got {prefix_len}")
    rng = np.random.default_rng(seed)
    prefixes = [_random_tokens(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    suffixes, outputs = sample_lengths(suffix_dist, num_requests, rng)
    arrivals = poisson_arrivals(rate, num_requests, rng)
    which = rng.integers(0, num_prefixes, size=num_requests)
    trace = []
    for i in range(num_requests):
        suffix_len = min(int(suffixes[i]), suffix_dist.max_prompt - prefix_len)
        prompt = prefixes[which[i]] + _random_tokens(rng, suffix_len, vocab_size)
        output = min(int(outputs[i]), suffix_dist.max_total - len(prompt))
        trace.append(TraceRequest(f"prefix-{seed}-{i}", float(arrivals[i]), prompt, output, int(which[i])))
    return trace


def trace_stats(trace: list[TraceRequest]) -> dict[str, float]:
    """Mean input/output lengths and the realised arrival rate of a trace."""
    if not trace:
        return {"num": 0, "input_mean": 0.0, "output_mean": 0.0, "rate": 0.0}
    span = trace[-1].arrival_time
    return {
        "num": len(trace),
        "input_mean": float(np.mean([r.prompt_len for r in trace])),
        "output_mean": float(np.mean([r.output_len for r in trace])),
        "rate": len(trace) / span if span > 0 else float("inf"),
    }
