"""The one placement rule: which candidates are near enough the least loaded to be chosen.

Both levels of placement use it: an engine core choosing an executor for a request
(``scheduler_svc/engine/router.py``, by prefix-cache hits) and a front choosing an engine core
(``scheduler_svc/front/core_set.py``, by rendezvous hashing of the prompt's first block). Each
prefers the candidate that already caches the prompt, but only among those whose load is within
the skew bound of the least loaded: that bound is what stops one hot prefix from swamping a
single executor or core (SGLang's cache-aware router "death spiral"). Once the holder of a prefix
is more than the bound busier, the request goes elsewhere, which then caches the prefix too.

    bound = min_load + max(SKEW_ABS, SKEW_REL * min_load)
"""

from __future__ import annotations

from collections.abc import Sequence

SKEW_ABS = 8  # requests: a candidate within this of the least loaded is eligible...
SKEW_REL = 0.5  # ...or within 50% of the least loaded's load, whichever is larger


def within_skew(loads: Sequence[float]) -> list[int]:
    """Indices of the candidates whose load is within the skew bound of the least loaded
    (never empty when ``loads`` is not)."""
    if not loads:
        return []
    least = min(loads)
    bound = least + max(SKEW_ABS, SKEW_REL * least)
    return [i for i, load in enumerate(loads) if load <= bound]
