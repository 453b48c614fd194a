"""A chat choice with tools, streamed or whole, says the same: the same tokens run through both
renderings (``ChatRender.chunk`` and ``ChatRender.add`` + ``response``), ended by EOS or cut by
max_tokens after any token, give the same content, the same calls (names, arguments) and the same
finish reason, for every parser, whatever the model wrote."""

from __future__ import annotations

import functools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedserve.engine_api import ChoiceDelta, FinishReason, RequestOutput, Usage
from scheduler_svc.front.http.responses import ChatRender, TokenTexts
from scheduler_svc.front.output.detokenize import IncrementalDetokenizer
from scheduler_svc.front.tool_calls import ToolPlan
from scheduler_svc.front.tool_calls.parsers import AUTO_PARSERS, NamedParser, RequiredParser
from testing.grpc_fakes import make_tokenizer

HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
SCRIPTS = {  # parser -> what a model may write: calls, no call, markers that begin none, whitespace
    "hermes": ["Let me look.\n" + HERMES_CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}'
               "\n</tool_call>",
               "I could write <tool_call> here, but the weather is sunny.",
               "\n" + HERMES_CALL,
               'Use <tool_call> tags.\n<tool_call>{"arguments": {}}</tool_call>' + HERMES_CALL],
    "llama3_json": ['<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {"tz": "CET"}}',
                    '{"not": "a call"} said the model', "Sunny."],
    "mistral": ['Let me look. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {"tz": "CET"}}]',
                "[TOOL_CALLS] is how I call tools, but not now."],
    "required": ['[{"name": "get_time", "parameters": {"tz": "UTC"}}, {"name": "get_weather", "parameters": '
                 '{"city": "Oslo"}}]'],
    "named": ['{"city": "Oslo", "unit": "celsius"}'],
}
PARSERS = {"required": RequiredParser, "named": lambda: NamedParser("get_weather"), **AUTO_PARSERS}
FINISH = {"named": None}  # a named function finishes "stop", as OpenAI answers; the others "tool_calls"


@functools.cache
def _tok():
    return make_tokenizer()


def _outputs(text: str, cut: int | None) -> list[RequestOutput]:
    """The engine's deltas for ``text``, a token each, through the real detokenizer: ended by EOS, or
    by max_tokens after ``cut`` tokens."""
    ids = _tok().encode(text, add_special_tokens=False).ids
    ids = ids[:cut] if cut is not None else ids + [1]
    detok = IncrementalDetokenizer(_tok(), [0], [])
    out = []
    for i, tid in enumerate(ids):
        d = ChoiceDelta(index=0, token_ids=[tid])
        if tid == 1:
            d.text, d.finish_reason = detok.finish(), FinishReason.EOS
        else:
            d.text = detok.step(tid)
            if i == len(ids) - 1:
                d.text += detok.finish()
                d.finish_reason = FinishReason.LENGTH
        last = d.finish_reason != FinishReason.UNSPECIFIED
        out.append(RequestOutput("r", [d], usage=Usage(1, i + 1, 0) if last else None, finished=last))
    return out


def _render(parser: str) -> ChatRender:
    plan = ToolPlan(None, PARSERS[parser](), None, FINISH.get(parser, "tool_calls"))
    return ChatRender("chatcmpl-r", "m", 1, 1, TokenTexts(_tok()), tools=plan)


def _whole(parser: str, outputs: list[RequestOutput]) -> tuple[str, list[tuple[str, str]], str]:
    render = _render(parser)
    for out in outputs:
        render.add(0, out)
    (choice,) = render.response()["choices"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls", [])]
    return choice["message"]["content"] or "", calls, choice["finish_reason"]


def _streamed(parser: str, outputs: list[RequestOutput]) -> tuple[str, list[tuple[str, str]], str]:
    render = _render(parser)
    content, calls, reasons = "", {}, []
    for out in outputs:
        for chunk in render.chunk(0, out):
            (choice,) = chunk["choices"]
            content += choice["delta"].get("content") or ""
            for d in choice["delta"].get("tool_calls", []):
                name, args = calls.get(d["index"], (None, ""))
                calls[d["index"]] = (name or d["function"].get("name"), args + d["function"]["arguments"])
            if choice["finish_reason"]:
                reasons.append(choice["finish_reason"])
    assert len(reasons) == 1 and sorted(calls) == list(range(len(calls)))
    return content, [calls[i] for i in sorted(calls)], reasons[0]


@pytest.mark.parametrize("parser,text", [(p, t) for p, texts in SCRIPTS.items() for t in texts])
def test_streamed_and_whole_agree_however_the_output_ends(parser, text):
    n = len(_tok().encode(text, add_special_tokens=False).ids)
    for cut in [None, *range(1, n + 1)]:
        outputs = _outputs(text, cut)
        assert _streamed(parser, outputs) == _whole(parser, outputs), (cut, text)


def test_a_marker_that_begins_no_call_is_content_in_full():
    text = SCRIPTS["hermes"][1]
    assert _streamed("hermes", _outputs(text, None)) == (text, [], "stop")


def test_a_call_cut_short_before_its_name_is_content_and_after_it_a_call_with_partial_arguments():
    text = SCRIPTS["hermes"][0]
    ids = _tok().encode(text, add_special_tokens=False).ids
    before = next(k for k in range(len(ids)) if _tok().decode(ids[:k + 1]).endswith('"name": "get'))
    content, calls, reason = _whole("hermes", _outputs(text, before + 1))
    assert content.endswith('"name": "get') and (calls, reason) == ([], "length")
    after = next(k for k in range(len(ids)) if '"Par' in _tok().decode(ids[:k + 1]))
    content, calls, reason = _whole("hermes", _outputs(text, after + 1))
    assert (content, reason) == ("Let me look.\n", "length")
    assert len(calls) == 1 and calls[0][0] == "get_weather" and calls[0][1].startswith('{"city": "Par')


def test_required_cut_short_before_a_call_is_named_is_no_content_and_no_call():
    # The grammar's JSON is no answer: it was shown as content ('[{"'); vLLM answers content "".
    text = SCRIPTS["required"][0]
    ids = _tok().encode(text, add_special_tokens=False).ids
    named = next(k for k in range(len(ids)) if '"name": "' in _tok().decode(ids[:k + 1]))
    for cut in range(1, named + 1):
        outputs = _outputs(text, cut)
        assert _whole("required", outputs) == _streamed("required", outputs) == ("", [], "length"), cut


def test_a_named_function_cut_short_is_its_call_with_the_arguments_so_far():
    content, calls, reason = _whole("named", _outputs(SCRIPTS["named"][0], 4))
    assert content == "" and reason == "length"
    assert calls == [("get_weather", _tok().decode(_tok().encode(SCRIPTS["named"][0]).ids[1:5]))]


_PIECE = st.sampled_from(["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", '{"name": "f"',
                          ', "arguments": ', ', "parameters": ', '{"a": 1}', "}", "[", "]", ";", " ", "\n", "x",
                          '"', "é", "🙂"])


@settings(max_examples=60, deadline=None)
@given(parser=st.sampled_from(list(PARSERS)), pieces=st.lists(_PIECE, max_size=12), cut=st.integers(1, 40))
def test_streamed_and_whole_agree_on_any_text(parser, pieces, cut):
    text = "".join(pieces) or "x"
    for end in (None, cut):
        outputs = _outputs(text, end)
        assert _streamed(parser, outputs) == _whole(parser, outputs), text
