"""The HTTP front over the fake engine: structured-output fields reach the engine as one checked
spec, tool calls are parsed out of scripted outputs (every parser, streaming and not, through the
official openai client), and every row of the "no field ignored" table is honoured."""

from __future__ import annotations

import json

import openai
import pytest

from pagedserve.wire import STRUCTURED_CHOICE, STRUCTURED_GRAMMAR, STRUCTURED_JSON, STRUCTURED_REGEX
from scheduler_svc.front.http.chat_template import ChatTemplate
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.front.tool_calls import ToolCallOptions
from scheduler_svc.telemetry.metrics import Metrics
from testing.grpc_fakes import FakeEngine, make_tokenizer
from testing.http_fakes import CHATML, HttpThread
from testing.tool_templates import TOOLS

MODEL = "tiny-test"
USER = [{"role": "user", "content": "Weather in Paris?"}]
SCRIPTS = {  # what a model of each family writes to call get_weather and get_time
    "hermes": 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
              '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>',
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                   '{"name": "get_time", "parameters": {"tz": "CET"}}',
    "mistral": 'Let me look. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
               '{"name": "get_time", "arguments": {"tz": "CET"}}]',
}
CONTENT = {"hermes": "Let me look.\n", "llama3_json": None, "mistral": "Let me look. "}


def _server(parser: str | None = None, **kw) -> HttpThread:
    engine = FakeEngine(make_tokenizer(), 2048)
    engine.ready = True
    options = ToolCallOptions(parser is not None, parser)
    return HttpThread(engine, ChatTemplate.compile(CHATML), ServerLimits(max_n=4, max_logprobs=5), metrics=Metrics(),
                      tool_options=options, **kw)


@pytest.fixture(scope="module")
def fake():
    srv = _server()
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _reset(request):
    if "fake" in request.fixturenames:
        srv = request.getfixturevalue("fake")
        srv.engine.reset()


# ------------------------------------------------------------------ structured outputs reach the engine

@pytest.mark.parametrize("extra,kind,spec", [
    ({"response_format": {"type": "json_object"}}, STRUCTURED_JSON, '{"type":"object"}'),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "strict": True, "schema": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}}, STRUCTURED_JSON,
     '{"type":"object","properties":{"a":{"type":"integer"}}}'),
    ({"structured_outputs": {"json": {"type": "array", "maxItems": 2}}}, STRUCTURED_JSON,
     '{"type":"array","maxItems":2}'),
    ({"structured_outputs": {"regex": "[a-z]{3}"}}, STRUCTURED_REGEX, "[a-z]{3}"),
    ({"structured_outputs": {"choice": ["yes", "no", "yes"]}}, STRUCTURED_CHOICE, '["yes", "no"]'),
    ({"structured_outputs": {"grammar": 'root ::= "a" | "b"'}}, STRUCTURED_GRAMMAR, 'root ::= "a" | "b"'),
    ({"guided_regex": "x+"}, STRUCTURED_REGEX, "x+"),
    ({"guided_choice": ["x"]}, STRUCTURED_CHOICE, '["x"]'),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_each_structured_output_field_reaches_the_engine_as_one_checked_spec(fake, extra, kind, spec, path):
    body = {"prompt": "Hi"} if path == "/v1/completions" else {"messages": USER}
    status, raw = fake.request("POST", path, {**body, **extra, "max_tokens": 4})
    assert status == 200, raw
    sp = fake.engine.requests[-1].params.sampling
    assert (sp.structured.kind, sp.structured.spec) == (kind, spec)
    assert sp.end_token_ids == [1]  # the model's EOS ends a structured output


def test_logit_bias_min_tokens_stop_strings_and_prompt_logprobs_reach_the_engine(fake):
    fake.client().completions.create(model=MODEL, prompt="Hi", max_tokens=8, logit_bias={"5": -100, "7": 2.5},
                                     extra_body={"min_tokens": 3, "include_stop_str_in_output": True,
                                                 "prompt_logprobs": 2, "stop_token_ids": [9]})
    req = fake.engine.requests[-1]
    sp = req.params.sampling
    assert sp.logit_bias == [(5, -100.0), (7, 2.5)] and sp.min_tokens == 3 and sp.prompt_logprobs == 2
    assert sp.end_token_ids == [1, 9]  # EOS, then the stop token ids: what min_tokens holds back
    assert req.params.include_stop_str_in_output and sp.processed_logprobs is False  # raw by default


def test_the_logprobs_mode_is_the_deployments():
    srv = _server(logprobs_mode="processed_logprobs")
    try:
        srv.client().completions.create(model=MODEL, prompt="Hi", max_tokens=2, logprobs=1)
        assert srv.engine.requests[-1].params.sampling.processed_logprobs
    finally:
        srv.stop()


# ------------------------------------------------------------------ tool calls

def _stream_calls(stream) -> tuple[str, dict[int, dict], list[str], int]:
    """(content, calls by index with concatenated arguments, finish reasons, chunks) of a chat stream."""
    content, calls, reasons, chunks = "", {}, [], 0
    for chunk in stream:
        chunks += 1
        for c in chunk.choices:
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or tc.id
                call["name"] = call["name"] or (tc.function.name if tc.function else None)
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            if c.finish_reason:
                reasons.append(c.finish_reason)
    return content, calls, reasons, chunks


@pytest.mark.parametrize("parser", list(SCRIPTS))
def test_auto_tool_calls_are_parsed_whole_and_streamed_as_deltas(parser):
    srv = _server(parser)
    try:
        srv.engine.completions = [SCRIPTS[parser]]
        client = srv.client()
        r = client.chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
        (choice,) = r.choices
        assert choice.finish_reason == "tool_calls" and choice.message.content == CONTENT[parser]
        calls = choice.message.tool_calls
        assert [c.function.name for c in calls] == ["get_weather", "get_time"]
        assert json.loads(calls[0].function.arguments) == {"city": "Paris", "unit": "celsius"}
        assert json.loads(calls[1].function.arguments) == {"tz": "CET"}
        assert len({c.id for c in calls}) == 2 and all(c.type == "function" for c in calls)
        if parser == "mistral":
            assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)  # what Mistral's template demands
        content, streamed, reasons, chunks = _stream_calls(client.chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, stream=True))
        assert content == (CONTENT[parser] or "") and reasons == ["tool_calls"]
        assert [c["name"] for c in streamed.values()] == ["get_weather", "get_time"]
        assert [json.loads(c["arguments"]) for c in streamed.values()] == [json.loads(c.function.arguments)
                                                                          for c in calls]
        assert chunks > len(streamed) + 2  # the arguments came in pieces, as generated
    finally:
        srv.stop()


def test_without_a_call_the_text_is_content_and_the_finish_reason_stop():
    srv = _server("hermes")
    try:
        srv.engine.completions = ["Sunny, I think. <tool_ca"]  # a marker's beginning that never completes
        r = srv.client().chat.completions.create(model=MODEL, messages=USER, tools=TOOLS)
        assert r.choices[0].message.content == "Sunny, I think. <tool_ca" and r.choices[0].finish_reason == "stop"
        assert not r.choices[0].message.tool_calls
        content, calls, reasons, _ = _stream_calls(srv.client().chat.completions.create(
            model=MODEL, messages=USER, tools=TOOLS, stream=True))
        assert content == "Sunny, I think. <tool_ca" and not calls and reasons == ["stop"]
    finally:
        srv.stop()


def test_required_and_named_tool_choice_are_grammars_and_their_output_is_the_call(fake):
    fake.engine.completions = ['[{"name": "get_time", "parameters": {"tz": "UTC"}}]']
    r = fake.client().chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="required")
    sp = fake.engine.requests[-1].params.sampling
    schema = json.loads(sp.structured.spec)
    assert sp.structured.kind == STRUCTURED_JSON and schema["type"] == "array" and schema["minItems"] == 1
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments) == {"tz": "UTC"}
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None

    fake.engine.completions = ['{"city": "Oslo", "unit": "celsius"}']
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = fake.client().chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice=named)
    assert json.loads(fake.engine.requests[-1].params.sampling.structured.spec) == TOOLS[0]["function"]["parameters"]
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo",
                                                                                         "unit": "celsius"})
    assert r.choices[0].finish_reason == "stop"  # as OpenAI answers a named function
    _, calls, _, _ = _stream_calls(fake.client().chat.completions.create(
        model=MODEL, messages=USER, tools=TOOLS, tool_choice=named, stream=True))
    assert calls[0]["name"] == "get_weather" and json.loads(calls[0]["arguments"]) == {"city": "Oslo", "unit": "celsius"}


def test_tool_choice_none_renders_the_tools_and_parses_nothing(fake):
    fake.engine.completions = ['<tool_call>{"name": "get_time", "arguments": {}}</tool_call>']
    r = fake.client().chat.completions.create(model=MODEL, messages=USER, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content.startswith("<tool_call>") and not r.choices[0].message.tool_calls
    assert fake.engine.requests[-1].params.sampling.structured is None


def test_mistral_calls_are_read_with_special_tokens_kept_when_bot_is_special():
    from scheduler_svc.front.tool_calls import plan_tools
    from scheduler_svc.front.tool_calls.requests import ToolCallOptions as Options

    class T:
        def __init__(self, name):
            self.type, self.function = "function", type("F", (), {"name": name, "description": None,
                                                                  "parameters": None})()

    plan = plan_tools([T("f")], "auto", None, Options(True, "mistral"), frozenset({"[TOOL_CALLS]"}))
    assert plan.skip_special_tokens is False
    assert plan_tools([T("f")], "auto", None, Options(True, "mistral"), frozenset()).skip_special_tokens


# ------------------------------------------------------------------ the table's other rows

def test_n_streamed_choices_arrive_one_per_chunk_with_continuous_usage(fake):
    fake.engine.completions = ["Hello world", "Good day"]
    chunks = list(fake.client().completions.create(
        model=MODEL, prompt="Hi", n=2, max_tokens=20, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    body = [c for c in chunks if c.choices]
    assert all(len(c.choices) == 1 for c in body)
    assert {c.choices[0].index for c in body} == {0, 1}
    assert all(c.usage.prompt_tokens == 3 for c in body)  # <s> H i
    # Each chunk counts its own choice (test_http_stream_usage.py); the last chunk, every choice.
    last = {c.choices[0].index: c.usage.completion_tokens for c in body}
    assert chunks[-1].usage.completion_tokens == sum(last.values())


def test_completion_logprobs_list_k_plus_one_with_the_sampled_token(fake):
    for k in (0, 2):
        r = fake.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3, logprobs=k)
        lp = r.choices[0].logprobs
        for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert top[token] == value and len(top) <= k + 1
        assert k or all(len(top) == 1 for top in lp.top_logprobs)  # logprobs=0: the sampled token's


def test_echo_with_logprobs_returns_the_prompts_log_probs_first(fake):
    r = fake.client().completions.create(model=MODEL, prompt="Hello world", max_tokens=2, logprobs=1, echo=True)
    lp = r.choices[0].logprobs
    prompt_ids = fake.engine.requests[-1].prompt_token_ids
    assert fake.engine.requests[-1].params.sampling.prompt_logprobs == 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
    assert lp.token_logprobs[1:len(prompt_ids)] == pytest.approx([-1.0 - j / 10 for j in range(len(prompt_ids) - 1)])
    assert lp.tokens[:len(prompt_ids)] == [make_tokenizer().decode([t], skip_special_tokens=False) for t in prompt_ids]
    # Positions in the returned text, which the BOS ("<s>", skipped when decoding) is not part of.
    assert lp.tokens[0] == "<s>" and lp.text_offset == [sum(len(t) for t in lp.tokens[1:i]) for i in range(len(lp.tokens))]
    assert all(r.choices[0].text.startswith(t, at) for t, at in zip(lp.tokens[1:-1], lp.text_offset[1:-1], strict=True))


@pytest.mark.parametrize("generated", ["Hello world, the end.", ""])  # "": the one token generated is EOS
@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_max_tokens_0_scores_the_prompt_alone(fake, stream, generated):
    # OpenAI's and vLLM's prompt scoring (lm-eval-harness's loglikelihood): the echo and its log-probs only.
    fake.engine.completions = [generated]
    kw = dict(model=MODEL, prompt="Hello world", max_tokens=0, echo=True, logprobs=1, n=2)
    if stream:
        chunks = list(fake.client().completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        usage = chunks[-1].usage
        parts = {i: [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i] for i in (0, 1)}
        texts = {i: "".join(p.text for p in ps) for i, ps in parts.items()}
        tokens = {i: [t for p in ps if p.logprobs for t in p.logprobs.tokens] for i, ps in parts.items()}
        finish = {i: ps[-1].finish_reason for i, ps in parts.items()}
    else:
        r = fake.client().completions.create(**kw)
        usage = r.usage
        texts = {c.index: c.text for c in r.choices}
        tokens = {c.index: c.logprobs.tokens for c in r.choices}
        finish = {c.index: c.finish_reason for c in r.choices}
        assert r.choices[0].logprobs.token_logprobs[0] is None
    (req,) = fake.engine.requests
    assert (req.params.max_tokens, req.params.sampling.prompt_logprobs) == (1, 1)  # one token, dropped
    prompt_tokens = [make_tokenizer().decode([t], skip_special_tokens=False) for t in req.prompt_token_ids]
    assert texts == {0: "Hello world", 1: "Hello world"} and tokens == {0: prompt_tokens, 1: prompt_tokens}
    assert finish == {0: "length", 1: "length"}
    n = len(req.prompt_token_ids)
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (n, 0, n)
    # Without echo, max_tokens 0 asks for nothing (vLLM: "max_tokens must be at least 1").
    err = json.loads(fake.request("POST", "/v1/completions", {"prompt": "a", "max_tokens": 0})[1])["error"]
    assert (err["message"], err["param"]) == ("max_tokens: must be >= 1 (got 0)", "max_tokens")


SPLIT = "Zaż 😀 gęś café, naïve 🚀!"  # characters the fake engine's tokenizer splits over tokens


def _chat_logprobs(fake, stream: bool) -> tuple[str, list]:
    """(content, logprobs entries) of a chat answer, whole or streamed."""
    kw = {"model": MODEL, "messages": USER, "logprobs": True, "top_logprobs": 1}
    if not stream:
        choice = fake.client().chat.completions.create(**kw).choices[0]
        return choice.message.content, choice.logprobs.content
    chunks = [c.choices[0] for c in fake.client().chat.completions.create(stream=True, **kw) if c.choices]
    return ("".join(c.delta.content or "" for c in chunks),
            [e for c in chunks if c.logprobs is not None for e in c.logprobs.content])


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_bytes_concatenate_to_the_contents_utf8(fake, stream):
    fake.engine.completions = [SPLIT]
    content, entries = _chat_logprobs(fake, stream)
    assert content == SPLIT and any("\ufffd" in e.token for e in entries)  # some token is a piece of a character
    assert entries[-1].token == "</s>" and entries[-1].bytes == list(b"</s>")  # EOS: not part of the content
    assert b"".join(bytes(e.bytes) for e in entries[:-1]) == SPLIT.encode()
    assert all(bytes(e.bytes).decode() == e.token for e in entries if "\ufffd" not in e.token)


def _completion(fake, stream: bool, **kw) -> tuple[str, list[str], list[int]]:
    """(text, tokens, text_offset) of a completion, whole or streamed (its chunks' lists joined)."""
    kw = {"model": MODEL, "max_tokens": 64, "logprobs": 1, **kw}
    if not stream:
        choice = fake.client().completions.create(**kw).choices[0]
        return choice.text, choice.logprobs.tokens, choice.logprobs.text_offset
    chunks = [c.choices[0] for c in fake.client().completions.create(stream=True, **kw)]
    lps = [c.logprobs for c in chunks if c.logprobs is not None]
    return ("".join(c.text for c in chunks), [t for lp in lps for t in lp.tokens],
            [o for lp in lps for o in lp.text_offset])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("echo", [False, True])
def test_text_offsets_are_character_positions_in_the_returned_text(fake, stream, echo):
    fake.engine.completions = [SPLIT]
    prompt = "Grüße 😀 naïve"
    text, tokens, offsets = _completion(fake, stream, prompt=prompt, echo=echo)
    head = prompt if echo else ""
    assert text == head + SPLIT and any("\ufffd" in t for t in tokens)
    # Exactly: the length of the text the tokens before decode to (a piece: its character's start).
    tok = make_tokenizer()
    prompt_ids = fake.engine.requests[-1].prompt_token_ids if echo else []
    answer_ids = tok.encode(SPLIT, add_special_tokens=False).ids + [1]
    expected = [len(tok.decode(prompt_ids[:i]).rstrip("\ufffd")) for i in range(len(prompt_ids))]
    expected += [len(head) + len(tok.decode(answer_ids[:i]).rstrip("\ufffd")) for i in range(len(answer_ids))]
    assert offsets == expected and offsets == sorted(offsets) and offsets[-1] == len(text)
    assert all(text.startswith(t, at) for t, at in zip(tokens, offsets, strict=True)
               if "\ufffd" not in t and t not in ("<s>", "</s>"))


def test_prompt_logprobs_are_reported_in_vllms_form(fake):
    r = fake.request("POST", "/v1/completions", {"prompt": "Hello", "max_tokens": 2, "prompt_logprobs": 1})
    body = json.loads(r[1])["choices"][0]["prompt_logprobs"]
    ids = fake.engine.requests[-1].prompt_token_ids
    assert body[0] is None and len(body) == len(ids)
    assert body[1][str(ids[1])]["logprob"] == -1.0 and body[1]["2"]["rank"] == 1
    assert ids[1] != 2 and body[1][str(ids[1])]["rank"] == 2  # the executor's rank, over the vocabulary


def test_a_prompt_tokens_rank_is_the_executors_else_given_only_where_the_top_k_make_it_exact():
    from pagedserve.engine_api import TokenLogprob
    from scheduler_svc.front.http.logprob_forms import prompt_logprobs_body

    ranked = prompt_logprobs_body(str, [TokenLogprob(7, -20.5, rank=4817), TokenLogprob(7, -1.5, [3, 7], [-0.2, -1.5], 2)])
    assert ranked == [{"7": {"logprob": -20.5, "rank": 4817, "decoded_token": "7"}},
                      {"3": {"logprob": -0.2, "rank": 1, "decoded_token": "3"},
                       "7": {"logprob": -1.5, "rank": 2, "decoded_token": "7"}}]
    # From an executor that reports no rank (older than PromptLogprobs.token_ranks):
    lps = [None,
           TokenLogprob(7, -20.5),  # k = 0: nothing says where " zebra" ranks (it was reported 1)
           TokenLogprob(7, -1.5, [3, 7, 9], [-0.2, -1.5, -3.0]),  # among the top k: its rank there
           TokenLogprob(7, -9.0, [3, 9], [-0.2, -3.0])]  # below them: rank 3 or anything after
    body = prompt_logprobs_body(str, lps)
    assert body[0] is None
    assert body[1] == {"7": {"logprob": -20.5, "rank": None, "decoded_token": "7"}}
    assert {t: e["rank"] for t, e in body[2].items()} == {"3": 1, "7": 2, "9": 3}
    assert {t: e["rank"] for t, e in body[3].items()} == {"3": 1, "9": 2, "7": None}


def test_a_request_the_server_aborted_is_an_error_never_finish_reason_abort(fake):
    fake.engine.mode = "aborted"
    with pytest.raises(openai.APIStatusError) as e:
        fake.client().completions.create(model=MODEL, prompt="Hi", max_tokens=8)
    assert e.value.status_code == 503
    with pytest.raises(openai.APIError):
        list(fake.client().completions.create(model=MODEL, prompt="Hi", max_tokens=8, stream=True))


def test_tokenize_detokenize_version_and_metrics_on_the_api_port(fake):
    status, raw = fake.request("POST", "/tokenize", {"prompt": "Hello world"})
    tokens = json.loads(raw)["tokens"]
    assert status == 200 and tokens == make_tokenizer().encode("Hello world").ids
    assert json.loads(raw)["count"] == len(tokens) and json.loads(raw)["max_model_len"] == 2048
    chat = json.loads(fake.request("POST", "/tokenize", {"messages": USER})[1])["tokens"]
    rendered = ChatTemplate.compile(CHATML).render(USER)
    assert chat == make_tokenizer().encode(rendered, add_special_tokens=False).ids
    body = {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}}
    assert json.loads(fake.request("POST", "/tokenize", body)[1])["tokens"] == chat  # (a variable it does not read)
    status, raw = fake.request("POST", "/tokenize", {"messages": USER, "chat_template_kwargs": {"tools": []}})
    assert status == 400 and json.loads(raw)["error"]["param"] == "chat_template_kwargs"
    strs = json.loads(fake.request("POST", "/tokenize", {"prompt": "Hello world", "return_token_strs": True})[1])
    assert strs["tokens"] == tokens and strs["token_strs"] == [make_tokenizer().id_to_token(i) for i in tokens]
    reply = [*USER, {"role": "assistant", "content": "Hello, I"}]
    body = {"messages": reply, "add_generation_prompt": False, "continue_final_message": True}
    open_reply = json.loads(fake.request("POST", "/tokenize", body)[1])["tokens"]
    rendered = ChatTemplate.compile(CHATML).render(reply, False, continue_final_message=True)
    assert rendered.endswith("Hello, I") and open_reply == make_tokenizer().encode(rendered, add_special_tokens=False).ids
    status, raw = fake.request("POST", "/tokenize", {"messages": reply, "continue_final_message": True})
    assert status == 400 and json.loads(raw)["error"]["param"] == "continue_final_message"
    status, raw = fake.request("POST", "/detokenize", {"tokens": tokens[1:]})
    assert status == 200 and json.loads(raw)["prompt"] == "Hello world"
    status, raw = fake.request("POST", "/detokenize", {"tokens": [10**6]})
    assert status == 400 and json.loads(raw)["error"]["param"] == "tokens"
    status, raw = fake.request("GET", "/version")
    assert status == 200 and json.loads(raw)["version"]
    status, raw = fake.request("GET", "/metrics")
    assert status == 200 and b"pagedserve:" in raw
    status, raw = fake.request("HEAD", "/metrics")
    assert status == 200 and raw == b""


def test_continuous_usage_stats_without_include_usage_adds_no_usage(fake):
    # vLLM: include_continuous_usage = include_usage and continuous_usage_stats; usage is opted into once.
    chunks = list(fake.client().completions.create(model=MODEL, prompt="Hi", max_tokens=3, stream=True,
                                                   stream_options={"continuous_usage_stats": True}))
    assert chunks and all(c.choices for c in chunks)  # no usage chunk at the end
    assert all("usage" not in c.model_dump(exclude_unset=True) for c in chunks)
