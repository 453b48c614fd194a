"""Structured outputs at the API edge: what a client asked for becomes one checked grammar spec.

Every way in (gRPC's ``SamplingParams.structured_outputs``, OpenAI's ``response_format``, vLLM's
``structured_outputs`` and its older ``guided_*`` fields, and ``tool_choice`` required or named)
becomes a :class:`StructuredFields`; :func:`structured_spec` turns it into the wire's
``Structured`` (kind + spec text: a JSON schema, a regex, a JSON list of choices, a GBNF grammar),
bounded, and checks it with a grammar engine before anything is scheduled, so an invalid schema or
grammar is a 400 / INVALID_ARGUMENT naming the field. The executors compile and apply it
(``executor_svc/grammar.py``).

The check uses llguidance, a grammar engine in Rust with no dependencies; the executors' engine,
xgrammar, imports torch and transformers, which no front installs. The two engines agree on what
is valid for everything the tests throw at them (tests/unit/front/test_structured_edge.py); where llguidance
is more lenient than xgrammar (bounds that contradict each other) this module checks itself, and
where it is stricter (``not``, some GBNF escapes) the request is rejected, never dropped. A spec
the executor still cannot compile fails that request's step (docs/ARCHITECTURE.md).

Checking is per request and runs in the front, never on the scheduling loop: the fronts validate
a request with a spec to check in a worker thread (``scheduler_svc/front/input/offload.py``, a bounded pool),
and verdicts are cached by spec (LRU), so a schema sent again costs a dictionary lookup.
"""

from __future__ import annotations

import collections
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.wire import (
    JSON_OBJECT_SCHEMA,
    MAX_STRUCTURED_CHARS,
    STRUCTURED_CHOICE,
    STRUCTURED_GRAMMAR,
    STRUCTURED_JSON,
    STRUCTURED_REGEX,
    Structured,
)

CACHE_ENTRIES = 4096  # verdicts kept (LRU): the specs of the busiest clients stay checked
_BOUND_PAIRS = (("minimum", "maximum"), ("exclusiveMinimum", "exclusiveMaximum"), ("minLength", "maxLength"),
                ("minItems", "maxItems"), ("minProperties", "maxProperties"))


class StructuredError(ValueError):
    """A spec that cannot be served: ``field`` (relative to the spec's own field) and what is wrong."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(detail)
        self.field, self.detail = field, detail


@dataclass(slots=True)
class StructuredFields:
    """What a client asked its output to follow (exactly one set), and the field it used (named in
    errors: ``sampling.structured_outputs`` on gRPC; ``response_format``, ``structured_outputs``,
    ``tool_choice``... over HTTP)."""

    field: str = "sampling.structured_outputs"
    json_schema: Any = None  # a schema: JSON text (gRPC) or the decoded value (HTTP)
    json_object: bool = False
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None

    def members(self) -> list[str]:
        given = [("json_schema", self.json_schema is not None), ("json_object", self.json_object),
                 ("regex", self.regex is not None), ("choice", self.choice is not None),
                 ("grammar", self.grammar is not None)]
        return [name for name, set_ in given if set_]


def structured_spec(f: StructuredFields, max_chars: int) -> Structured:
    """The wire spec of ``f``, bounded by ``max_chars`` characters and checked (StructuredError)."""
    members = f.members()
    if len(members) != 1:
        raise StructuredError("", f"exactly one of json_schema, json_object, regex, choice, grammar must be given "
                                  f"(got {', '.join(members) or 'none'})")
    limit = min(max_chars, MAX_STRUCTURED_CHARS)
    name = members[0]
    if name in ("json_schema", "json_object"):
        spec = Structured(STRUCTURED_JSON, JSON_OBJECT_SCHEMA if f.json_object else _schema_text(f.json_schema, limit))
    elif name == "regex":
        spec = Structured(STRUCTURED_REGEX, _bounded("regex", f.regex or "", limit))
    elif name == "choice":
        spec = Structured(STRUCTURED_CHOICE, _choices(f.choice or (), limit))
    else:
        spec = Structured(STRUCTURED_GRAMMAR, _bounded("grammar", f.grammar or "", limit))
    error = CHECKER.verdict(spec)
    if error is not None:
        raise StructuredError(name, error)
    return spec


def needs_check(f: StructuredFields | None) -> bool:
    """Whether validating ``f`` may run a grammar engine (not a cached verdict): the fronts then
    validate the request in a worker thread."""
    return f is not None and bool(f.members()) and not f.json_object and not CHECKER.knows(f)


def _schema_text(schema: Any, limit: int) -> str:
    if isinstance(schema, str):
        _bounded("json_schema", schema, limit)
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise StructuredError("json_schema", f"is not valid JSON ({e})") from None
        except RecursionError:  # [[[[...]]]]: the client's error, never a crash
            raise StructuredError("json_schema", "is nested more than 64 levels deep") from None
    if not isinstance(schema, (dict, bool)):
        raise StructuredError("json_schema", f"must be a JSON object (got {type(schema).__name__})")
    text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False)
    _bounded("json_schema", text, limit)
    _check_bounds(schema, "json_schema")
    return text


def _check_bounds(node: Any, path: str, depth: int = 0) -> None:
    """Lower bounds above upper ones (which xgrammar rejects and llguidance lets through)."""
    if depth > 64:
        raise StructuredError("json_schema", "is nested more than 64 levels deep")
    if isinstance(node, dict):
        for lo, hi in _BOUND_PAIRS:
            a, b = node.get(lo), node.get(hi)
            if _number(a) and _number(b) and a > b:
                raise StructuredError("json_schema", f"{path}: {lo} ({a}) is greater than {hi} ({b})")
        for key, value in node.items():
            if isinstance(value, (dict, list)):
                _check_bounds(value, f"{path}.{key}", depth + 1)
    elif isinstance(node, list):
        for i, value in enumerate(node):
            _check_bounds(value, f"{path}[{i}]", depth + 1)


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _bounded(name: str, text: str, limit: int) -> str:
    if not text:
        raise StructuredError(name, "must not be empty")
    if len(text) > limit:
        raise StructuredError(name, f"must be at most {limit} characters (got {len(text)})")
    return text


def _choices(choices: Sequence[str], limit: int) -> str:
    if not choices:
        raise StructuredError("choice", "must list at least one string")
    for i, c in enumerate(choices):
        if not isinstance(c, str) or not c:
            raise StructuredError(f"choice[{i}]", "must be a non-empty string")
    text = json.dumps(list(dict.fromkeys(choices)), ensure_ascii=False)
    if len(text) > limit:
        raise StructuredError("choice", f"must be at most {limit} characters as JSON (got {len(text)})")
    return text


class _Checker:
    """Verdicts of llguidance on specs (None: valid), cached by spec."""

    def __init__(self, entries: int) -> None:
        self._verdicts: collections.OrderedDict[tuple[int, str], str | None] = collections.OrderedDict()
        self._entries = entries
        self._lock = threading.Lock()  # checks run in worker threads

    def knows(self, f: StructuredFields) -> bool:
        """Whether the verdict on ``f``'s spec is cached (a cheap guess: by its text as given)."""
        if f.regex is not None:
            key = (STRUCTURED_REGEX, f.regex)
        elif f.grammar is not None:
            key = (STRUCTURED_GRAMMAR, f.grammar)
        elif isinstance(f.json_schema, str):
            key = (STRUCTURED_JSON, f.json_schema)
        else:
            return False  # a decoded schema or choices: its text is only known after dumping it
        with self._lock:
            return key in self._verdicts

    def verdict(self, spec: Structured) -> str | None:
        key = (spec.kind, spec.spec)
        with self._lock:
            if key in self._verdicts:
                self._verdicts.move_to_end(key)
                return self._verdicts[key]
        error = _check(spec)
        with self._lock:
            self._verdicts[key] = error
            while len(self._verdicts) > self._entries:
                self._verdicts.popitem(last=False)
        return error


def _check(spec: Structured) -> str | None:
    """llguidance's verdict on ``spec``: None when valid, else what is wrong."""
    import llguidance

    matcher = llguidance.LLMatcher
    if spec.kind == STRUCTURED_CHOICE:
        return None  # any non-empty strings (checked above) make a valid grammar
    try:
        if spec.kind == STRUCTURED_JSON:
            grammar = matcher.grammar_from_json_schema(spec.spec)
        elif spec.kind == STRUCTURED_REGEX:
            grammar = matcher.grammar_from_regex(spec.spec)
        else:
            from llguidance.gbnf_to_lark import gbnf_to_lark

            grammar = matcher.grammar_from_lark(gbnf_to_lark(spec.spec))
        error = matcher.validate_grammar(grammar, None)
    except Exception as e:  # noqa: BLE001  the converters raise on malformed input: the client's error
        error = str(e) or type(e).__name__
    return _tidy(error) if error else None


def _tidy(message: str) -> str:
    """llguidance's message on one line, bounded (it may quote the whole spec)."""
    text = " ".join(message.split())
    return text if len(text) <= 400 else text[:397] + "..."


CHECKER = _Checker(CACHE_ENTRIES)
