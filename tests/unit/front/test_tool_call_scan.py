"""A streamed choice's tool calls are parsed again each time its text grows, resuming the JSON
scans of the parse before (a ``ScanMemo`` per choice): at every length, that parse must equal a
fresh parse of the same text, for every parser, whatever the arguments hold (quotes, escapes,
braces inside strings, unicode) and wherever the text is cut."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_svc.front.tool_calls.parsers import AUTO_PARSERS, NamedParser, RequiredParser, ToolParser
from scheduler_svc.front.tool_calls.stream import ChoiceToolCalls

_TEXT = st.text(alphabet=st.sampled_from(list('ab {}[]"\\:,\n\u00e9\U0001f600')), max_size=12)
_JSON = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | _TEXT,
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_TEXT, inner, max_size=3),
                     max_leaves=8)
_CALLS = st.lists(st.tuples(st.sampled_from(["get_weather", "f"]), st.dictionaries(_TEXT, _JSON, max_size=3)),
                  min_size=1, max_size=3)


def _script(parser: str, calls: list[tuple[str, dict]], quoted: bool) -> str:
    """What a model of ``parser``'s family writes for ``calls`` (arguments as a JSON string when ``quoted``)."""
    def args(a: dict):
        return json.dumps(a) if quoted else a

    if parser == "hermes":
        return "Checking.\n" + "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': args(a)})}\n</tool_call>\n"
                                       for n, a in calls)
    if parser == "llama3_json":
        return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    if parser == "mistral":
        return "Checking. [TOOL_CALLS] " + json.dumps([{"name": n, "arguments": args(a)} for n, a in calls])
    if parser == "required":
        return json.dumps([{"name": n, "parameters": a} for n, a in calls])
    return json.dumps(calls[0][1])


def _parser(name: str) -> ToolParser:
    return {"required": RequiredParser, "named": lambda: NamedParser("f")}.get(name, AUTO_PARSERS.get(name))()


@settings(max_examples=150, deadline=None)
@given(name=st.sampled_from([*AUTO_PARSERS, "required", "named"]), calls=_CALLS, quoted=st.booleans(),
       tail=_TEXT, cuts=st.lists(st.integers(1, 6), min_size=1, max_size=40))
def test_a_parse_resumed_from_the_last_equals_a_fresh_parse_at_every_length(name, calls, quoted, tail, cuts):
    text = _script(name, calls, quoted) + tail  # (the tail: whatever a model writes after, or garbage)
    parser, memo = _parser(name), {}
    at, k = 0, 0
    while at < len(text):
        at = min(len(text), at + cuts[k % len(cuts)])
        k += 1
        assert parser.parse(text[:at], False, memo) == parser.parse(text[:at], False), text[:at]
    assert parser.parse(text, True, memo) == parser.parse(text, True)


@settings(max_examples=50, deadline=None)
@given(name=st.sampled_from(list(AUTO_PARSERS)), calls=_CALLS, step=st.integers(1, 7))
def test_streamed_argument_deltas_add_up_to_the_whole_responses_calls(name, calls, step):
    text = _script(name, calls, False)
    stream = ChoiceToolCalls(_parser(name))
    args: dict[int, str] = {}
    for at in range(0, len(text), step):
        for d in stream.delta(text[at:at + step], False)[1]:
            args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    for d in stream.delta("", True)[1]:
        args[d["index"]] = args.get(d["index"], "") + d["function"]["arguments"]
    _, whole = ChoiceToolCalls(_parser(name)).message(text)
    assert [json.loads(args[i]) for i in sorted(args)] == [json.loads(c["function"]["arguments"]) for c in whole]
