"""Validated readers for decoding wire messages (see :mod:`scheduler_svc.plan`).

Decoding is the trust boundary between processes: every field of every frame
goes through one of these, which raise :class:`WireError` naming the field.
"""

from __future__ import annotations

from typing import Any


class WireError(ValueError):
    """A frame that is not a valid message of this wire version."""


def as_int(v: Any, name: str) -> int:
    if type(v) is not int:
        raise WireError(f"{name}: expected int, got {type(v).__name__}")
    return v


def as_opt_int(v: Any, name: str) -> int | None:
    return None if v is None else as_int(v, name)


def as_float(v: Any, name: str) -> float:
    if type(v) is float:
        return v
    if type(v) is int:
        return float(v)
    raise WireError(f"{name}: expected float, got {type(v).__name__}")


def as_str(v: Any, name: str) -> str:
    if type(v) is not str:
        raise WireError(f"{name}: expected str, got {type(v).__name__}")
    return v


def as_bool(v: Any, name: str) -> bool:
    if type(v) is not bool:
        raise WireError(f"{name}: expected bool, got {type(v).__name__}")
    return v


def as_list(v: Any, name: str, length: int | None = None) -> list:
    if type(v) is not list:
        raise WireError(f"{name}: expected list, got {type(v).__name__}")
    if length is not None and len(v) != length:
        raise WireError(f"{name}: expected {length} elements, got {len(v)}")
    return v


def as_ints(v: Any, name: str) -> list[int]:
    lst = as_list(v, name)
    for x in lst:
        if type(x) is not int:
            raise WireError(f"{name}: expected a list of int, found {type(x).__name__}")
    return lst


def as_pairs(v: Any, name: str) -> list[tuple[int, int]]:
    flat = as_ints(v, name)
    if len(flat) % 2:
        raise WireError(f"{name}: expected an even-length flat list of pairs")
    return list(zip(flat[0::2], flat[1::2], strict=True))


def flat_pairs(pairs: list[tuple[int, int]]) -> list[int]:
    return [x for p in pairs for x in p]
