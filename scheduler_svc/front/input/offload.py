"""Validating (tokenizing) a large prompt: off the event loop, a few at a time, memory given back.

Both fronts validate requests with a long text prompt in a worker thread so the
engine's loop never stalls on tokenization. A burst of maximum-size prompts would
otherwise run as many tokenizations at once as there are threads, each holding a
large encoding, and glibc keeps the freed heap: RSS stayed gigabytes above its
baseline after 20 prompts of 3.9 MB. So at most :data:`CONCURRENT` such
validations run at once, and the allocator is asked to return free memory after
each (``malloc_trim``, glibc only).
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import time
from collections.abc import Callable
from typing import TypeVar

from tokenizers import Tokenizer

THREAD_CHARS = 4096  # prompts longer than this are tokenized in a worker thread
CONCURRENT = 2  # large validations at once (each holds its text and its encoding)
T = TypeVar("T")

_slots: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}
_libc = ctypes.CDLL(ctypes.util.find_library("c")) if ctypes.util.find_library("c") else None
_trim = getattr(_libc, "malloc_trim", None)
_M_MMAP_THRESHOLD = -3  # glibc mallopt parameter
LARGE_ALLOCATION = 1 << 20


def return_large_allocations_to_the_os() -> bool:
    """Make every allocation of 1 MiB or more its own mapping (returned to the OS when freed).

    glibc raises its mmap threshold after a large block is freed (up to 32 MiB), so later
    multi-megabyte request messages land on the heap and stay in RSS after they are gone. A
    fixed threshold turns that off. Call once at start-up; False where it does not apply.
    """
    mallopt = getattr(_libc, "mallopt", None)
    return bool(mallopt and mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION))


def token_ids(tokenizer: Tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    """``text``'s token ids, the GIL released while the Rust tokenizer runs: ``encode`` holds it
    throughout, so a long prompt tokenized in a worker thread still froze the event loop (a
    585K-character prompt: the loop stopped 0.52-0.65 s of 0.58-0.70 s; through ``encode_batch``,
    46-65 ms at most, the ids' list being built). Same ids."""
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


async def validate_off_loop(size: int, fn: Callable[..., T], *args) -> T:
    """``fn(*args)`` inline for a small request (``size`` characters), else in a worker thread."""
    if size <= THREAD_CHARS:
        return fn(*args)
    loop = asyncio.get_running_loop()
    slots = _slots.setdefault(loop, asyncio.Semaphore(CONCURRENT))
    async with slots:
        return await asyncio.to_thread(_then_trim, fn, *args)


def _then_trim(fn: Callable[..., T], *args) -> T:
    """``fn(*args)``, then the encoding's freed pages back to the OS: in the worker thread, since
    walking the heap takes a while and the event loop must not wait for it."""
    try:
        return fn(*args)
    finally:
        if _trim is not None:
            _trim(0)


_last_trim = 0.0
TRIM_INTERVAL_S = 1.0


def trim_soon() -> None:
    """Give freed heap back to the OS after a large request was read and dropped (grpc core
    receives a message in small slices, which the mmap threshold does not catch), in a worker
    thread, at most once per TRIM_INTERVAL_S however many such requests arrive."""
    global _last_trim
    now = time.monotonic()
    if _trim is None or now - _last_trim < TRIM_INTERVAL_S:
        return
    _last_trim = now
    asyncio.get_running_loop().run_in_executor(None, _trim, 0)
