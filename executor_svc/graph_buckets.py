"""Batch-size buckets of the CUDA decode graphs (executor_svc/decode_graphs.py): the flag's
parsing and the choice of a bucket, apart from torch so the executor's flags parse without it."""

from __future__ import annotations

import bisect

DEFAULT_SIZES = (1, 2, 4, 8, *range(16, 257, 8))
MAX_GRAPH_SIZE = 1024


def parse_sizes(text: str) -> tuple[int, ...]:
    """``--cuda-graph-sizes``: comma-separated batch sizes, each in [1, MAX_GRAPH_SIZE]."""
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise ValueError(f"--cuda-graph-sizes: comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1 or sizes[-1] > MAX_GRAPH_SIZE:
        raise ValueError(f"--cuda-graph-sizes: sizes in [1, {MAX_GRAPH_SIZE}], got {text!r}")
    return tuple(sizes)


def bucket_for(n: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest size >= n (None: n is above the largest, the step runs eagerly)."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None
