"""The API edge checks a spec with llguidance; the executors compile it with xgrammar. Every spec the
edge lets through must compile on the executors (else the request fails after it was scheduled),
so the two engines are held to the same verdicts here: random schemas, each supported form, and
the invalid specs clients send. Where llguidance is the stricter one (``not``, a GBNF escape) the
edge refuses: a 400 a client can act on, never a failure later."""

from __future__ import annotations

import json

import pytest

from executor_svc.grammar import GrammarBackend, GrammarError
from pagedserve.wire import (
    STRUCTURED_CHOICE,
    STRUCTURED_GRAMMAR,
    STRUCTURED_JSON,
    STRUCTURED_REGEX,
    Structured,
)
from scheduler_svc.front.input.structured import (
    CHECKER,
    StructuredError,
    StructuredFields,
    needs_check,
    structured_spec,
)
from testing.json_schemas import random_schema

VALID = [
    StructuredFields(json_schema={"type": "object", "properties": {"a": {"type": "string", "format": "email"}}}),
    StructuredFields(json_schema={"type": "object", "patternProperties": {"^x": {"type": "integer"}}}),
    StructuredFields(json_schema={"type": "string", "pattern": "^[a-z]+$"}),
    StructuredFields(json_schema={"type": "array", "prefixItems": [{"type": "integer"}], "items": False}),
    StructuredFields(json_schema={"oneOf": [{"type": "integer"}, {"type": "string", "maxLength": 2}]}),
    StructuredFields(json_schema={"allOf": [{"type": "object", "properties": {"a": {"type": "boolean"}}}]}),
    StructuredFields(json_schema={"type": "object", "properties": {"a": {"const": 3}}, "required": ["a"]}),
    StructuredFields(json_object=True),
    StructuredFields(regex=r"(cat|dog)s? \d{2,4}"),
    StructuredFields(regex=r"[A-Z][a-z]*(, [A-Z][a-z]*)*\."),
    StructuredFields(choice=["yes", "no", "a \"quoted\" one"]),
    StructuredFields(grammar='root ::= "(" item ("," item)* ")"\nitem ::= [a-z]+ | "#" [0-9]{1,3}'),
    StructuredFields(grammar='root ::= answer\nanswer ::= "yes" | "no"  # a comment'),
]
INVALID = [
    StructuredFields(json_schema={"type": "wizard"}),
    StructuredFields(json_schema={"$ref": "#/$defs/nowhere"}),
    StructuredFields(json_schema={"type": "integer", "minimum": 5, "maximum": 1}),
    StructuredFields(json_schema={"type": "array", "minItems": 3, "maxItems": 1}),
    StructuredFields(json_schema={"type": "string", "pattern": "(?<=a)b"}),
    StructuredFields(regex="a(b"),
    StructuredFields(regex="(?<=a)b"),
    StructuredFields(regex=r"(a)\1"),
    StructuredFields(grammar="root ::= missing"),
    StructuredFields(grammar="start: lark_not_gbnf"),
]
STRICTER_AT_THE_EDGE = [  # xgrammar would serve these; the edge refuses them, with a reason
    StructuredFields(json_schema={"not": {"type": "string"}}),
    StructuredFields(grammar='root ::= "\\u00e9"'),
]


@pytest.fixture(scope="module")
def backend(tiny_llama_dir):
    return GrammarBackend.for_model(tiny_llama_dir, 512)


def _executor_compiles(backend, spec: Structured) -> bool:
    g = backend.track(spec, [0], [])
    try:
        g.matcher()
    except GrammarError:
        return False
    return True


def _edge(f: StructuredFields) -> Structured | None:
    try:
        return structured_spec(f, 1 << 16)
    except StructuredError:
        return None


@pytest.mark.parametrize("f", VALID, ids=lambda f: f.members()[0])
def test_what_the_edge_accepts_compiles_on_the_executor(backend, f):
    spec = _edge(f)
    assert spec is not None and _executor_compiles(backend, spec)


@pytest.mark.parametrize("f", INVALID, ids=lambda f: f.members()[0])
def test_what_the_executor_cannot_compile_the_edge_refuses(backend, f):
    assert _edge(f) is None
    kind = {"json_schema": STRUCTURED_JSON, "regex": STRUCTURED_REGEX, "grammar": STRUCTURED_GRAMMAR}[f.members()[0]]
    text = json.dumps(f.json_schema) if f.json_schema is not None else f.regex or f.grammar
    assert not _executor_compiles(backend, Structured(kind, text))


@pytest.mark.parametrize("f", STRICTER_AT_THE_EDGE, ids=lambda f: f.members()[0])
def test_where_the_edge_is_stricter_it_refuses_with_a_reason(f):
    with pytest.raises(StructuredError) as e:
        structured_spec(f, 1 << 16)
    assert e.value.detail


def test_random_bounded_schemas_pass_both(backend):
    for seed in range(100):
        spec = _edge(StructuredFields(json_schema=random_schema(seed)))
        assert spec is not None and _executor_compiles(backend, spec), seed


def test_verdicts_are_cached_by_spec_so_a_repeat_needs_no_worker_thread():
    f = StructuredFields(regex="[0-9]{4}-cache-test")
    assert needs_check(f)
    structured_spec(f, 1 << 16)
    assert not needs_check(f) and CHECKER.knows(f)
    assert not needs_check(StructuredFields(json_object=True))  # a fixed schema: nothing to check
    choice = structured_spec(StructuredFields(choice=["a", "b"]), 1 << 16)
    assert choice == Structured(STRUCTURED_CHOICE, '["a", "b"]')
