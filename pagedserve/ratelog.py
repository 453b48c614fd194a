"""Logging what peers send wrong without letting them flood the log.

A hostile or broken peer can send thousands of bad frames a second; one
WARNING each would fill disks and drown real events. :class:`RateLimitedLog`
logs the first occurrence, then at most one line per interval that says how
many were suppressed meanwhile.
"""

from __future__ import annotations

import logging
import time


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, interval_s: float = 10.0, level: int = logging.WARNING) -> None:
        self.logger, self.interval_s, self.level = logger, interval_s, level
        self._next = 0.0
        self._suppressed = 0

    def __call__(self, msg: str, *args) -> None:
        now = time.monotonic()
        if now < self._next:
            self._suppressed += 1
            return
        if self._suppressed:
            msg += f" (and {self._suppressed} more like it in the last {self.interval_s:g}s)"
            self._suppressed = 0
        self._next = now + self.interval_s
        self.logger.log(self.level, msg, *args)
