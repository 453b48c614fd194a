"""Random JSON schemas whose every instance is bounded: strings have ``maxLength``, arrays
``maxItems``, numbers bounds, objects no additional properties. What the structured-output tests
feed the grammar engine: ``$ref`` / ``$defs``, ``enum``, ``anyOf``, numbers with bounds, arrays
with ``minItems``, optional properties, nesting.
"""

from __future__ import annotations

import random
from typing import Any

MAX_DEPTH = 3


def random_schema(seed: int) -> dict[str, Any]:
    """A schema whose root is an object (what response_format's json_schema takes)."""
    rng = random.Random(seed)
    defs: dict[str, Any] = {}
    if rng.random() < 0.4:
        defs["item"] = _node(rng, MAX_DEPTH - 1, {})
    root = _object(rng, 0, defs)
    if defs:
        root["$defs"] = defs
    return root


def _node(rng: random.Random, depth: int, defs: dict[str, Any]) -> dict[str, Any]:
    leaves = ("string", "integer", "number", "boolean", "enum", "null")
    kinds = leaves if depth >= MAX_DEPTH else leaves + ("object", "array", "anyOf", "ref")
    kind = rng.choice(kinds)
    if kind == "string":
        s: dict[str, Any] = {"type": "string", "maxLength": rng.randint(0, 8)}
        if rng.random() < 0.3:
            s["minLength"] = rng.randint(0, s["maxLength"])
        return s
    if kind == "integer":
        lo = rng.randint(-100, 100)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 1000)}
    if kind == "number":
        lo = rng.choice([-1.0, 0.0, 0.5, 10.0])
        return {"type": "number", "minimum": lo, "maximum": lo + rng.choice([1.0, 5.0, 100.0])}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2.5, True, None, "a b"], rng.randint(1, 4))}
    if kind == "object":
        return _object(rng, depth + 1, defs)
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": _node(rng, depth + 1, defs), "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    if kind == "anyOf":
        return {"anyOf": [_node(rng, depth + 1, defs) for _ in range(rng.randint(2, 3))]}
    if "item" in defs:  # ref
        return {"$ref": "#/$defs/item"}
    return {"type": "boolean"}


def _object(rng: random.Random, depth: int, defs: dict[str, Any]) -> dict[str, Any]:
    names = rng.sample(["id", "name", "size", "tags", "kind", "ok", "value", "items"], rng.randint(1, 4))
    props = {n: _node(rng, depth + 1, defs) for n in names}
    required = [n for n in names if rng.random() < 0.75]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}
