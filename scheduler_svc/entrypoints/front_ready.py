"""A front tells the scheduler that started it that it serves, or why it could not start.

The scheduler hands each front the write end of a pipe (its number in ``PAGEDSERVE_FRONT_READY_FD``).
The front writes ``ready`` once both APIs listen, or, when its start fails, ``failed`` and the
reason (the message naming the flag, or the exception), then exits. The scheduler reads the
other end (``children.py``): a front that exits before it was ever ready stops the scheduler,
saying why, instead of being started again forever (a bad flag or a taken port fails every try).
A front started by hand (``pagedserve-front``) has no pipe, and all this does nothing.
"""

from __future__ import annotations

import os

READY_FD = "PAGEDSERVE_FRONT_READY_FD"
READY, FAILED = b"ready\n", b"failed "
MAX_REASON_BYTES = 2000  # one message, not a traceback


def report_ready() -> None:
    _report(READY)


def report_failure(exc: BaseException) -> None:
    """Why this front's start failed (a no-op once it was ready: the pipe is closed then)."""
    if isinstance(exc, SystemExit):
        reason = exc.code if isinstance(exc.code, str) else f"exited with status {exc.code}"
    else:
        reason = f"{type(exc).__name__}: {exc}"
    _report(FAILED + reason.encode(errors="replace")[:MAX_REASON_BYTES] + b"\n")


def _report(line: bytes) -> None:
    fd = os.environ.pop(READY_FD, None)  # (once: the first report is the one that counts)
    if not fd:
        return
    try:
        os.write(int(fd), line)
        os.close(int(fd))
    except (OSError, ValueError):  # the scheduler is gone (this front follows it) or the variable is not ours
        pass


class ReadyPipe:
    """The scheduler's end of one front's pipe: ``fd_for_child`` goes to the front (and is closed here
    once it started), ``poll`` reads what arrived."""

    def __init__(self) -> None:
        self._read, self.fd_for_child = os.pipe()
        os.set_blocking(self._read, False)
        self._got = b""
        self.ready = False

    def child_started(self) -> None:
        os.close(self.fd_for_child)

    def poll(self) -> None:
        """Read what the front wrote (ready, or its reason); sets ``ready``."""
        while self._read >= 0:
            try:
                chunk = os.read(self._read, 4096)
            except BlockingIOError:
                break
            if not chunk:  # the front closed it (it reported, or exited)
                self.close()
                break
            self._got += chunk
        self.ready = self._got.startswith(READY)

    def failure(self) -> str | None:
        """The reason the front wrote, if it wrote one (read after it exited)."""
        self.poll()
        if self._got.startswith(FAILED):
            return self._got[len(FAILED):].decode(errors="replace").strip()
        return None

    def close(self) -> None:
        if self._read >= 0:
            os.close(self._read)
            self._read = -1
