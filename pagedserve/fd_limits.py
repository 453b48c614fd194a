"""Open-file headroom: every process raises its soft ``RLIMIT_NOFILE`` to the hard limit at start.

A Linux login's soft limit is often 1,024 while the hard limit allows far more. Every client
connection holds a descriptor, so at the soft limit a flood of idle connections leaves none for
a new client, and the kernel resets it before any code of ours can answer. Raising the soft
limit costs nothing (the kernel allocates descriptors on use); vLLM does the same at start. The
fronts then cap their connections below what is left (``scheduler_svc/front/http/serve.py``).
"""

from __future__ import annotations

import logging

try:
    import resource
except ImportError:  # not a POSIX system: nothing to raise
    resource = None  # type: ignore[assignment]

log = logging.getLogger(__name__)


def raise_open_files_limit() -> tuple[int, int]:
    """Soft ``RLIMIT_NOFILE`` := hard (capped at 1,048,576 when the hard one is unlimited);
    returns (soft, hard) after, and logs both with what the soft limit was."""
    if resource is None:
        return (-1, -1)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:  # a sandbox may refuse: serve with what there is
            log.warning("open files: cannot raise the soft limit %d to %d (%s)", soft, target, exc)
            return soft, hard
    new_soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    log.info("open files: soft limit %d (was %d), hard limit %s", new_soft, soft,
             "unlimited" if hard == resource.RLIM_INFINITY else hard)
    return new_soft, hard


# Descriptors a front keeps beyond its connection caps: health probes (served past the HTTP cap),
# the links to its engine core, log files.
CONNECTION_RESERVE = 128


def connection_cap(configured: int, open_files: int) -> int:
    """Connections a front serves: ``configured`` when given (> 0), else the open-files limit less
    CONNECTION_RESERVE (at least 16; 65,536 when the limit is unknown)."""
    if configured:
        return configured
    return max(16, open_files - CONNECTION_RESERVE) if open_files > 0 else 1 << 16


def open_files_limit() -> int:
    """The current soft limit (-1: unknown)."""
    if resource is None:
        return -1
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
