"""POST /v1/responses over the fake engine, through the official openai client: the same engine
request and text as the chat route for the same messages, the whole response and the stream's
events as the client parses them, status ``incomplete`` at max_output_tokens, text.format as a
grammar, function tools as chat's (function_call items in and out, parsed and streamed), each
refused field named, disconnects and errors, and no engine request left open. (Against a real
model, greedy text equal to chat's, a JSON schema and a forced tool call: the ``slow`` tests at the end.)"""

from __future__ import annotations

import json
import time

import openai
import pytest

from pagedserve.wire import STRUCTURED_JSON
from scheduler_svc.front.http.body_parser import BodyParser
from scheduler_svc.front.http.chat_template import ChatTemplate
from scheduler_svc.front.http.responses_api_fields import METADATA_PAIRS
from scheduler_svc.front.input.parse_pool import ParseWorker
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.front.tool_calls import ToolCallOptions
from scheduler_svc.telemetry.metrics import Metrics
from testing.grpc_fakes import FakeEngine, make_tokenizer
from testing.http_fakes import CHATML, HttpThread
from testing.tool_templates import QWEN25, TOOLS, history

SPECIAL = {"bos_token": "<|endoftext|>", "eos_token": "<|endoftext|>"}
MODEL = "tiny-test"
MESSAGES = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "What is paged attention?"},
            {"role": "assistant", "content": "KV cache in blocks."}, {"role": "user", "content": "Block size?"}]
SCHEMA = {"type": "object", "properties": {"size": {"type": "integer"}}, "required": ["size"]}
HEAD = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
TAIL = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(make_tokenizer(), 2048)
    srv = HttpThread(engine, ChatTemplate.compile(CHATML), ServerLimits(), metrics=Metrics())
    yield srv
    srv.stop()


@pytest.fixture
def fake(server):
    """The server as a test finds it; after the test, every engine request it made must be closed."""
    yield server.fresh()
    _all_closed(server.engine)


def _all_closed(engine: FakeEngine) -> None:
    deadline = time.monotonic() + 5
    while len(engine.closed) < len(engine.requests) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(engine.closed) == len(engine.requests), "an engine request was left open"


def _as_items(messages: list[dict]) -> list[dict]:
    """Chat messages as Responses input items, in both forms (plain text, and typed text parts)."""
    return [{"role": m["role"], "content": m["content"]} if i % 2 else
            {"type": "message", "role": m["role"],
             "content": [{"type": "output_text" if m["role"] == "assistant" else "input_text", "text": m["content"]}]}
            for i, m in enumerate(messages)]


def _events(stream) -> list:
    return list(stream)


# ------------------------------------------------------------------ the chat route's request and text

def test_a_response_is_the_chat_routes_request_and_text_for_the_same_messages(fake):
    client = fake.client()
    chat = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, top_p=0.5, max_tokens=40)
    chat_req = fake.engine.requests[-1]
    r = client.responses.create(model=MODEL, input=_as_items(MESSAGES), temperature=0, top_p=0.5,
                                max_output_tokens=40)
    req = fake.engine.requests[-1]
    assert req.prompt_token_ids == chat_req.prompt_token_ids  # the same template, the same tokens
    assert req.params.sampling == chat_req.params.sampling and req.params.max_tokens == chat_req.params.max_tokens
    assert r.output_text == chat.choices[0].message.content
    assert r.object == "response" and r.status == "completed" and r.incomplete_details is None
    assert r.id == f"resp_{req.request_id}" and r.model == MODEL
    (item,) = r.output
    assert (item.type, item.role, item.status, item.id) == ("message", "assistant", "completed", f"msg_{req.request_id}")
    (part,) = item.content
    assert part.type == "output_text" and part.annotations == []
    u = r.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (chat.usage.prompt_tokens,
                                                                  chat.usage.completion_tokens, chat.usage.total_tokens)
    assert u.input_tokens_details.cached_tokens == chat.usage.prompt_tokens_details.cached_tokens
    assert u.output_tokens_details.reasoning_tokens == 0
    assert (r.temperature, r.top_p, r.max_output_tokens) == (0.0, 0.5, 40)


def test_an_earlier_responses_refusal_sent_back_is_its_text(fake):
    client = fake.client()
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"},
                                                          {"role": "assistant", "content": "I can't."},
                                                          {"role": "user", "content": "Why?"}])
    expected = fake.engine.requests[-1].prompt_token_ids
    client.responses.create(model=MODEL, input=[
        {"role": "user", "content": "Hi"},
        {"type": "message", "role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
        {"role": "user", "content": "Why?"}])
    assert fake.engine.requests[-1].prompt_token_ids == expected


def test_a_string_input_is_one_user_message_and_instructions_a_system_message_first(fake):
    client = fake.client()
    client.chat.completions.create(model=MODEL, messages=[{"role": "system", "content": "Only French."},
                                                          {"role": "user", "content": "Hi"}])
    expected = fake.engine.requests[-1].prompt_token_ids
    r = client.responses.create(model=MODEL, input="Hi", instructions="Only French.")
    assert fake.engine.requests[-1].prompt_token_ids == expected and r.instructions == "Only French."
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    expected = fake.engine.requests[-1].prompt_token_ids
    r = client.responses.create(model=MODEL, input="Hi")
    assert fake.engine.requests[-1].prompt_token_ids == expected and r.instructions is None


def test_metadata_and_user_are_echoed_store_is_accepted_and_nothing_stored(fake):
    status, raw = fake.request("POST", "/v1/responses", {"model": MODEL, "input": "Hi", "store": True, "user": "u1",
                                                         "metadata": {"k": "v"}, "an_unknown_field": 1})
    body = json.loads(raw)
    assert status == 200 and body["metadata"] == {"k": "v"} and body["user"] == "u1"
    assert body["store"] is False and body["previous_response_id"] is None  # no store: nothing to refer back to
    status, _ = fake.request("GET", f"/v1/responses/{body['id']}")
    assert status in (404, 405)


def test_the_stream_is_openais_event_sequence_with_the_chat_routes_text(fake):
    client = fake.client()
    text = client.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].message.content
    events = _events(client.responses.create(model=MODEL, input=_as_items(MESSAGES), stream=True))
    kinds = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds == HEAD + ["response.output_text.delta"] * len(deltas) + TAIL + ["response.completed"]
    assert len(deltas) > 1 and [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in deltas) == text
    created, done = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == done.id
    assert events[-4].text == text and events[-3].part.text == text
    assert done.status == "completed" and done.output_text == text and done.output[0].status == "completed"
    assert done.usage.output_tokens == len(fake.engine.tok.encode(text, add_special_tokens=False).ids) + 1  # + EOS
    assert {e.item_id for e in deltas} == {done.output[0].id}


def test_the_stream_names_its_events_for_clients_that_read_the_event_field(fake):
    status, raw = fake.request("POST", "/v1/responses", {"model": MODEL, "input": "Hi", "stream": True})
    blocks = [b for b in raw.decode().split("\n\n") if b]
    assert status == 200 and blocks and b"[DONE]" not in raw
    for block in blocks:
        event, data = block.split("\n")
        assert event == "event: " + json.loads(data.removeprefix("data: "))["type"]


# ------------------------------------------------------------------ max_output_tokens, text.format

@pytest.mark.parametrize("stream", [False, True])
def test_max_output_tokens_ends_the_response_incomplete(fake, stream):
    fake.engine.completions = ["word " * 50]
    client = fake.client()
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                          max_completion_tokens=5)
    assert chat.choices[0].finish_reason == "length"
    if stream:
        events = _events(client.responses.create(model=MODEL, input="Hi", max_output_tokens=5, stream=True))
        assert events[-1].type == "response.incomplete"
        r = events[-1].response
    else:
        r = client.responses.create(model=MODEL, input="Hi", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 5
    assert r.output_text == chat.choices[0].message.content  # the text so far, kept


@pytest.mark.parametrize("fmt,spec", [
    ({"type": "json_schema", "name": "size", "schema": SCHEMA, "strict": True}, json.dumps(SCHEMA, separators=(",", ":"))),
    ({"type": "json_object"}, '{"type":"object"}'),
])
def test_text_format_is_the_chat_routes_structured_output(fake, fmt, spec):
    fake.engine.completions = ['{"size": 16}']
    r = fake.client().responses.create(model=MODEL, input="Block size?", text={"format": fmt})
    sp = fake.engine.requests[-1].params.sampling
    assert (sp.structured.kind, sp.structured.spec) == (STRUCTURED_JSON, spec)
    assert json.loads(r.output_text) == {"size": 16}
    assert r.text.format.type == fmt["type"]
    if fmt["type"] == "json_schema":
        assert r.text.format.name == "size" and r.text.format.schema_ == SCHEMA


def test_the_clients_stream_helper_and_parse_read_what_the_server_sends(fake):
    from pydantic import BaseModel

    class Size(BaseModel):
        size: int

    client = fake.client()
    with client.responses.stream(model=MODEL, input="Hi") as stream:
        deltas = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
        final = stream.get_final_response()
    assert final.output_text == deltas and final.status == "completed"
    fake.engine.completions = ['{"size": 16}']
    r = client.responses.parse(model=MODEL, input="Block size?", text_format=Size)
    assert r.output_parsed == Size(size=16)
    assert json.loads(fake.engine.requests[-1].params.sampling.structured.spec)["required"] == ["size"]


def test_text_format_text_asks_for_no_grammar(fake):
    fake.client().responses.create(model=MODEL, input="Hi", text={"format": {"type": "text"}})
    assert fake.engine.requests[-1].params.sampling.structured is None


def test_chats_sampling_fields_beyond_openais_reach_the_engine_as_on_chat(fake):
    """vLLM takes its sampling extensions (and chat's seed, stop, penalties, logit_bias) on
    /v1/responses too: each reaches the engine as the chat route sends it, none dropped."""
    extras = {"seed": 7, "stop": ["END"], "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1,
              "presence_penalty": 0.5, "frequency_penalty": 0.25, "logit_bias": {"5": 2.0}, "min_tokens": 2,
              "stop_token_ids": [9], "cache_salt": "tenant-a",
              "structured_outputs": {"regex": "[a-z]+"}}
    fake.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=1,
                                          max_tokens=30, extra_body=extras)
    chat_req = fake.engine.requests[-1]
    fake.client().responses.create(model=MODEL, input="Hi", temperature=1, max_output_tokens=30, extra_body=extras)
    req = fake.engine.requests[-1]
    assert req.params == chat_req.params and req.cache_salt == chat_req.cache_salt == "tenant-a"
    assert req.params.sampling.seed == 7 and req.params.stop == ["END"] and req.params.sampling.structured is not None


# ------------------------------------------------------------------ 400s naming the field

IMAGE = {"type": "input_image", "image_url": "https://example.com/a.png"}
REFUSED = [
    ({"previous_response_id": "resp_1"}, "previous_response_id", "previous_response_id"),
    ({"conversation": "conv_1"}, "conversation", "conversation"),
    ({"background": True}, "background", "background"),
    ({"prompt": {"id": "pmpt_1"}}, "prompt", "prompt"),
    ({"include": ["message.output_text.logprobs"]}, "include", "include"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs"),
    ({"truncation": "auto"}, "truncation", "truncation"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools[0].type"),
    ({"tools": [{"type": "function", "parameters": {}}]}, "tools", "tools[0].name"),
    ({"tools": [{"type": "function", "name": "a b"}]}, "tools", "tools[0].name"),
    ({"tools": [{"type": "function", "name": "f", "parameters": {"type": "string"}}]}, "tools", "tools[0].parameters"),
    ({"tools": [{"type": "function", "name": "f"}]}, "tool_choice", "tool_choice"),  # auto: no parser deployed
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     "tool_choice", "tool_choice.name"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "allowed_tools"}}, "tool_choice",
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice"),
    ({"input": ["Hi", {"role": "user", "content": [{"type": "input_text", "text": "a"}, IMAGE]}]}, "input",
     "input[0]"),  # (a bare string item is not an item: msgspec names it)
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "input_text", "text": "a"}]},
                {"role": "user", "content": [IMAGE]}]}, "input", "input[2].content[0].type"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input", "input[0].type"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input", "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c", "output": [IMAGE]}]}, "input",
     "input[0].output[0].type"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{not json"}]}, "input",
     "input[0].arguments"),
    ({"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, "input", "input[0].name"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input", "input[0].role"),
    ({"input": [{"content": "x"}]}, "input", "input[0].role"),
    ({"input": [{"role": "user"}]}, "input", "input[0].content"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input", "input[0].content[0].text"),
    ({"input": []}, "input", "input"),
    ({"input": None}, "input", "input"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"max_output_tokens": 5000}, "max_output_tokens", "max_output_tokens"),  # past max_model_len
    ({"temperature": -1}, "temperature", "temperature"),
    ({"top_p": 0}, "top_p", "top_p"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", "text.format.schema"),
    ({"text": {"format": {"type": "grammar"}}}, "text", "text.format.type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "no-such-type"}}}}, "text",
     "text.format.schema"),
    ({"metadata": {str(i): "v" for i in range(METADATA_PAIRS + 1)}}, "metadata", "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata", "metadata.k"),
    ({"input": "x" * 20000}, "input", "input"),  # longer than the model
    ({"priority": 1}, "priority", "priority"),  # chat's extras are chat's rules
    ({"bad_words": ["x"]}, "bad_words", "bad_words"),
    ({"stop": [""]}, "stop", "stop[0]"),
    ({"prompt_logprobs": 1}, "prompt_logprobs", "prompt_logprobs"),  # no place in a response
    ({"prompt_logprobs": 0}, "prompt_logprobs", "prompt_logprobs"),  # (the prompt's own: computed, then dropped)
    ({"use_beam_search": True}, "use_beam_search", "use_beam_search"),
    ({"return_token_ids": True}, "return_token_ids", "return_token_ids"),
    ({"structured_outputs": {"regex": "a+"}, "text": {"format": {"type": "json_object"}}}, "structured_outputs",
     "structured_outputs"),
]


@pytest.mark.parametrize("extra,param,field", REFUSED, ids=[r[2] + "-" + str(i) for i, r in enumerate(REFUSED)])
def test_what_is_not_served_is_a_400_naming_the_field(fake, extra, param, field):
    status, raw = fake.request("POST", "/v1/responses", {"model": MODEL, "input": "Hi", **extra})
    err = json.loads(raw)["error"]
    assert status == 400 and err["type"] == "invalid_request_error", raw
    assert err["param"] == param and err["message"].startswith(field), err
    assert not fake.engine.requests


def test_the_openai_client_gets_a_bad_request_error_naming_the_field(fake):
    with pytest.raises(openai.BadRequestError) as e:
        fake.client().responses.create(model=MODEL, input="Hi", previous_response_id="resp_123")
    assert e.value.param == "previous_response_id" and "stores no responses" in e.value.message


def test_an_unknown_model_is_a_404_and_a_model_without_template_a_400_naming_input(fake):
    with pytest.raises(openai.NotFoundError):
        fake.client().responses.create(model="other", input="Hi")
    engine = FakeEngine(make_tokenizer(), 2048)
    srv = HttpThread(engine)
    try:
        status, raw = srv.fresh().request("POST", "/v1/responses", {"model": MODEL, "input": "Hi"})
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == "input" and err["code"] == "no_chat_template"
    finally:
        srv.stop()


def test_a_template_refusing_the_messages_is_a_400_naming_input(fake):
    srv = HttpThread(FakeEngine(make_tokenizer(), 2048), ChatTemplate.compile("{{ raise_exception('roles must alternate') }}"))
    try:
        status, raw = srv.fresh().request("POST", "/v1/responses", {"model": MODEL, "input": "Hi"})
        err = json.loads(raw)["error"]
        assert status == 400 and err["param"] == "input" and err["message"].startswith("input: ")
        assert "roles must alternate" in err["message"]
    finally:
        srv.stop()


# ------------------------------------------------------------------ function tools (chat's machinery)

FLAT_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]  # the Responses API's form
HERMES = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
          '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')


@pytest.fixture(scope="module")
def hermes_server():
    srv = HttpThread(FakeEngine(make_tokenizer(), 4096), ChatTemplate.compile(QWEN25, SPECIAL), ServerLimits(),
                     tool_options=ToolCallOptions(True, "hermes"))
    yield srv
    srv.stop()


@pytest.fixture
def hermes(hermes_server):
    yield hermes_server.fresh()
    _all_closed(hermes_server.engine)


def _history_items(call_id: str) -> list[dict]:
    """testing.tool_templates.history (a call and its result) as Responses input items."""
    items = []
    for m in history(call_id):
        if m.get("tool_calls"):
            items += [{"type": "function_call", "call_id": c["id"], "name": c["function"]["name"],
                       "arguments": c["function"]["arguments"]} for c in m["tool_calls"]]
        elif m["role"] == "tool":
            items.append({"type": "function_call_output", "call_id": m["tool_call_id"], "output": m["content"]})
        else:
            items.append(m)
    return items


def test_tools_and_function_call_items_render_as_chats_tools_and_messages(hermes):
    client = hermes.client()
    client.chat.completions.create(model=MODEL, messages=history("call_1"), tools=TOOLS)
    expected = hermes.engine.requests[-1].prompt_token_ids
    client.responses.create(model=MODEL, input=_history_items("call_1"), tools=FLAT_TOOLS)
    assert hermes.engine.requests[-1].prompt_token_ids == expected
    assert b"18 degrees" in hermes.engine.tok.decode(expected).encode()  # (the result is in the prompt)


def _calls(items) -> list[tuple[str, dict]]:
    return [(i.name, json.loads(i.arguments)) for i in items if i.type == "function_call"]


def test_auto_tool_calls_are_function_call_items_whole_and_streamed(hermes):
    hermes.engine.completions = [HERMES]
    client = hermes.client()
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=TOOLS)
    want = [(c.function.name, json.loads(c.function.arguments)) for c in chat.choices[0].message.tool_calls]
    r = client.responses.create(model=MODEL, input="Weather?", tools=FLAT_TOOLS)
    assert [i.type for i in r.output] == ["message", "function_call", "function_call"] and r.status == "completed"
    assert r.output_text == chat.choices[0].message.content and _calls(r.output) == want
    assert all(i.status == "completed" and i.id == f"fc_{i.call_id}" for i in r.output[1:])
    assert len({i.call_id for i in r.output[1:]}) == 2 and [t.name for t in r.tools] == ["get_weather", "get_time"]

    events = list(client.responses.create(model=MODEL, input="Weather?", tools=FLAT_TOOLS, stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    done = events[-1].response
    assert events[-1].type == "response.completed" and _calls(done.output) == want
    assert done.output_text == r.output_text
    added = [e.item for e in events if e.type == "response.output_item.added"]
    assert [i.type for i in added] == ["message", "function_call", "function_call"]
    for index, item in enumerate(done.output[1:], 1):
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"
                  and e.output_index == index]
        (args_done,) = [e for e in events if e.type == "response.function_call_arguments.done"
                        and e.output_index == index]
        assert "".join(pieces) == args_done.arguments == item.arguments and item.id == added[index].id
    kinds = [e.type for e in events]
    assert kinds.index("response.output_item.done") > kinds.index("response.output_text.done")


def test_required_and_named_tool_choice_are_chats_grammars_and_their_output_the_call(hermes):
    client = hermes.client()
    user = [{"role": "user", "content": "Weather?"}]
    named = {"type": "function", "name": "get_weather"}
    for chat_choice, choice, script in (("required", "required", '[{"name": "get_time", "parameters": {"tz": "UTC"}}]'),
                                        ({"type": "function", "function": {"name": "get_weather"}}, named,
                                         '{"city": "Oslo", "unit": "celsius"}')):
        hermes.engine.completions = [script]
        chat = client.chat.completions.create(model=MODEL, messages=user, tools=TOOLS, tool_choice=chat_choice)
        spec = hermes.engine.requests[-1].params.sampling.structured
        r = client.responses.create(model=MODEL, input="Weather?", tools=FLAT_TOOLS, tool_choice=choice)
        assert hermes.engine.requests[-1].params.sampling.structured == spec and spec.kind == STRUCTURED_JSON
        want = [(c.function.name, json.loads(c.function.arguments)) for c in chat.choices[0].message.tool_calls]
        assert [i.type for i in r.output] == ["function_call"] and _calls(r.output) == want  # no message: no content
        events = list(client.responses.create(model=MODEL, input="Weather?", tools=FLAT_TOOLS, tool_choice=choice,
                                              stream=True))
        assert _calls(events[-1].response.output) == want and "response.output_text.delta" not in {
            e.type for e in events}


def test_tool_choice_none_renders_the_tools_and_reads_no_call(hermes):
    hermes.engine.completions = [HERMES]
    r = hermes.client().responses.create(model=MODEL, input="Weather?", tools=FLAT_TOOLS, tool_choice="none")
    assert [i.type for i in r.output] == ["message"] and r.output_text == HERMES
    assert hermes.engine.requests[-1].params.sampling.structured is None


# ------------------------------------------------------------------ errors, disconnects

def test_an_engine_error_before_the_first_output_keeps_its_status(fake):
    fake.engine.mode = "queue_full"
    with pytest.raises(openai.RateLimitError):
        fake.client().responses.create(model=MODEL, input="Hi", stream=True)


def test_an_error_mid_stream_is_an_error_event_the_client_raises(fake):
    fake.engine.mode = "fail"
    seen = []
    with pytest.raises(openai.APIError, match="executor returned garbage"):
        for e in fake.client().responses.create(model=MODEL, input="Hi", stream=True):
            seen.append(e.type)
    assert seen[:len(HEAD)] == HEAD and "response.completed" not in seen
    status, raw = fake.request("POST", "/v1/responses", {"model": MODEL, "input": "Hi", "stream": True})
    last = json.loads(raw.decode().strip().split("\n\n")[-1].split("\n")[1].removeprefix("data: "))
    assert status == 200 and last["type"] == "error" and last["error"]["code"] == last["code"]
    assert last["sequence_number"] > 0 and "executor returned garbage" in last["message"]


def _wait_closed(engine: FakeEngine, timeout_s: float = 5.0) -> tuple[str, bool]:
    assert engine.closed_event.wait(timeout_s), "the engine's generator was never closed"
    return engine.closed[-1]


def test_a_client_leaving_a_stream_cancels_the_request_at_once(fake):
    fake.engine.completions = ["word " * 200]
    fake.engine.token_delay = 0.02
    stream = fake.client().responses.create(model=MODEL, input="Hi", max_output_tokens=100, stream=True)
    for i, _ in enumerate(stream):
        if i == len(HEAD) + 2:
            break
    t0 = time.monotonic()
    stream.close()
    _, finished = _wait_closed(fake.engine)
    assert not finished and time.monotonic() - t0 < 1.0  # aborted, long before 100 tokens x 20 ms


def test_a_client_leaving_a_whole_response_cancels_the_request(fake):
    fake.engine.completions = ["word " * 200]
    fake.engine.token_delay = 0.05
    with pytest.raises(openai.APITimeoutError):
        fake.client(timeout=0.3).responses.create(model=MODEL, input="Hi", max_output_tokens=100)
    _, finished = _wait_closed(fake.engine)
    assert not finished


def test_a_large_body_is_decoded_by_the_parse_worker(fake):
    worker = ParseWorker()
    parser, fake.front.parser = fake.front.parser, BodyParser(large_bytes=64, worker=worker)
    try:
        r = fake.client().responses.create(model=MODEL, input=_as_items(MESSAGES), metadata={"k": "v"})
        assert fake.front.parser.offloaded == 1 and r.output_text and r.metadata == {"k": "v"}
        status, raw = fake.request("POST", "/v1/responses", {"input": [{"role": "user", "content": [IMAGE]}]})
        assert status == 400 and json.loads(raw)["error"]["message"].startswith("input[0].content[0].type")
    finally:
        fake.front.parser = parser
        fake.call(worker.close())


# ------------------------------------------------------------------ a real model (slow)

@pytest.fixture(scope="module")
def real(tiny_llama_dir):
    import torch

    torch.set_num_threads(1)
    from scheduler_svc.front.tool_calls import ToolCallOptions
    from testing.real_model_front import RealModelFront

    r = RealModelFront(tiny_llama_dir, {"qwen": (QWEN25, ToolCallOptions())})
    yield r
    r.stop()


@pytest.mark.slow
def test_a_real_model_answers_a_response_with_the_chat_routes_greedy_tokens(real):
    chat = real.client("qwen").chat.completions.create(model="tiny", messages=MESSAGES, temperature=0, max_tokens=24)
    r = real.client("qwen").responses.create(model="tiny", input=_as_items(MESSAGES), temperature=0, max_output_tokens=24)
    text = chat.choices[0].message.content
    assert r.output_text == text and r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    events = list(real.client("qwen").responses.create(model="tiny", input=_as_items(MESSAGES), temperature=0,
                                               max_output_tokens=24, stream=True))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert events[-1].response.output_text == text and events[-1].type == f"response.{r.status}"
    assert not real.engine.core.requests  # nothing left in the engine


@pytest.mark.slow
def test_a_real_model_held_to_a_json_schema_writes_json_that_parses(real):
    schema = {"type": "object", "properties": {"size": {"type": "integer", "minimum": 1, "maximum": 64}},
              "required": ["size"], "additionalProperties": False}
    r = real.client("qwen").responses.create(model="tiny", input="Block size?", temperature=0, max_output_tokens=60,
                                     text={"format": {"type": "json_schema", "name": "size", "schema": schema,
                                                      "strict": True}})
    assert r.status == "completed"
    value = json.loads(r.output_text)
    assert set(value) == {"size"} and 1 <= value["size"] <= 64


@pytest.mark.slow
def test_a_real_model_made_to_call_a_tool_writes_arguments_that_match_its_schema(real):
    import jsonschema

    schemas = {t["name"]: t["parameters"] for t in FLAT_TOOLS}
    for choice in ("required", {"type": "function", "name": "get_time"}):
        r = real.client("qwen").responses.create(model="tiny", input=_history_items("call_1"), tools=FLAT_TOOLS,
                                         tool_choice=choice, temperature=0, max_output_tokens=300)
        assert r.status == "completed" and r.output and all(i.type == "function_call" for i in r.output)
        for item in r.output:
            jsonschema.validate(json.loads(item.arguments), schemas[item.name])
        if isinstance(choice, dict):
            assert [i.name for i in r.output] == ["get_time"]
