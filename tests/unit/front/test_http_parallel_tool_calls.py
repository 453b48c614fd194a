"""``parallel_tool_calls: false`` under ``tool_choice: auto``: at most one call comes back, whole or
streamed, whatever the model writes (as OpenAI promises and vLLM does: the first call is kept).
``required`` is held to one call by its grammar instead (``tool_calls/requests.py``)."""

from __future__ import annotations

import json

import pytest

from scheduler_svc.front.http.chat_template import ChatTemplate
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.front.tool_calls import ToolCallOptions
from scheduler_svc.telemetry.metrics import Metrics
from testing.grpc_fakes import FakeEngine, make_tokenizer
from testing.http_fakes import CHATML, HttpThread

TWO_CALLS = ('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
FIRST = [("get_weather", '{"city": "Paris"}')]
BOTH = [*FIRST, ("get_weather", '{"city": "Rome"}')]


@pytest.fixture(scope="module")
def server():
    srv = HttpThread(FakeEngine(make_tokenizer(), 512), ChatTemplate.compile(CHATML), ServerLimits(max_n=4),
                     metrics=Metrics(), tool_options=ToolCallOptions(True, "hermes"))
    yield srv
    srv.stop()


@pytest.fixture()
def fake(server):
    server.fresh().engine.completions = [TWO_CALLS]
    return server


def _body(parallel: bool | None, stream: bool) -> dict:
    body = {"model": "tiny-test", "messages": [{"role": "user", "content": "Weather?"}], "max_tokens": 200,
            "tools": [TOOL], "tool_choice": "auto", "stream": stream}
    if parallel is not None:
        body["parallel_tool_calls"] = parallel
    return body


def _whole(fake, parallel: bool | None) -> tuple[str | None, list[tuple[str, str]], str]:
    status, raw = fake.request("POST", "/v1/chat/completions", _body(parallel, False))
    assert status == 200, raw
    (choice,) = json.loads(raw)["choices"]
    calls = [(c["function"]["name"], c["function"]["arguments"]) for c in choice["message"].get("tool_calls", [])]
    return choice["message"]["content"], calls, choice["finish_reason"]


def _streamed(fake, parallel: bool | None) -> tuple[str, list[tuple[str, str]], str]:
    status, raw = fake.request("POST", "/v1/chat/completions", _body(parallel, True))
    assert status == 200, raw
    content, calls, reason = "", {}, None
    for line in raw.decode().split("\n"):
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line[6:])["choices"]:
            content += choice["delta"].get("content") or ""
            for d in choice["delta"].get("tool_calls", []):
                name, args = calls.get(d["index"], (None, ""))
                calls[d["index"]] = (name or d["function"].get("name"), args + d["function"]["arguments"])
            reason = choice["finish_reason"] or reason
    return content, [calls[i] for i in sorted(calls)], reason


def test_parallel_tool_calls_false_keeps_the_first_call_whole_and_streamed(fake):
    assert _whole(fake, False) == ("Checking.\n", FIRST, "tool_calls")
    assert _streamed(fake, False) == ("Checking.\n", FIRST, "tool_calls")


@pytest.mark.parametrize("parallel", [None, True])
def test_parallel_tool_calls_unset_or_true_keeps_every_call(fake, parallel):
    assert _whole(fake, parallel) == ("Checking.\n", BOTH, "tool_calls")
    assert _streamed(fake, parallel) == ("Checking.\n", BOTH, "tool_calls")
