"""Waiting, bounded, for what another thread or process does after the test's own call returned
(a server releases a call's budget after the client has read its last byte, and so on)."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], timeout_s: float, what: str, interval_s: float = 0.05) -> None:
    """Return once ``predicate()`` is true; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")
        time.sleep(interval_s)
