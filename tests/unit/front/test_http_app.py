"""The OpenAI-compatible HTTP front in-process, over the fake engine: request mapping, response
shapes (through the official openai client), every error status, body bounds, disconnects."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import socket
import threading
import time

import msgspec
import openai
import pytest

from scheduler_svc.front.http.chat_template import ChatTemplate
from scheduler_svc.front.http.limits import HttpLimits
from scheduler_svc.front.http.openai_types import ChatRequest, CompletionRequest
from scheduler_svc.front.input import offload
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.telemetry.metrics import Metrics
from testing.grpc_fakes import FakeEngine, make_tokenizer
from testing.http_fakes import CHATML, HttpThread

LIMITS = ServerLimits(max_n=4, max_logprobs=5, max_stop_strings=2)
HTTP_LIMITS = HttpLimits(max_body_bytes=4096, max_messages=3, max_prompts=2)
MODEL = "tiny-test"
FULL = "Hello world, the end."  # what the fake engine generates
MAX_MODEL_LEN = 256
TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                         "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                        "required": ["city"]}}}


@pytest.fixture(scope="module")
def server():
    engine = FakeEngine(make_tokenizer(), MAX_MODEL_LEN)
    metrics = Metrics()
    srv = HttpThread(engine, ChatTemplate.compile(CHATML), LIMITS, HTTP_LIMITS, metrics)
    srv.metrics = metrics
    yield srv
    srv.stop()


@pytest.fixture()
def fake(server):
    return server.fresh()


def _error(status: int, body: bytes) -> dict:
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


# ------------------------------------------------------------------ results

def test_completion_text_usage_and_finish_reason(fake):
    r = fake.client().completions.create(model=MODEL, prompt="Hello", max_tokens=50)
    (choice,) = r.choices
    assert choice.text == FULL and choice.finish_reason == "stop"  # EOS -> "stop"
    (req,) = fake.engine.requests
    assert req.prompt_token_ids == make_tokenizer().encode("Hello").ids  # with BOS, like gRPC
    assert r.usage.prompt_tokens == len(req.prompt_token_ids)
    assert r.usage.completion_tokens == len(make_tokenizer().encode(FULL, add_special_tokens=False).ids) + 1
    assert r.usage.prompt_tokens_details.cached_tokens == 3  # from the engine's usage
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")
    assert "speculative_decoding" not in r.usage.model_dump()  # only where the request was speculated


def test_usage_reports_speculative_acceptance_beside_prompt_tokens_details(fake):
    fake.engine.spec_usage = (12, 7)
    r = fake.client().completions.create(model=MODEL, prompt="Hello", max_tokens=50)
    assert r.usage.model_dump()["speculative_decoding"] == {"proposed_tokens": 12, "accepted_tokens": 7}
    chunks = list(fake.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                         stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.model_dump()["speculative_decoding"] == {"proposed_tokens": 12, "accepted_tokens": 7}


def test_length_finish_and_default_max_tokens_per_endpoint(fake):
    r = fake.client().completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=2)
    assert r.choices[0].finish_reason == "length" and fake.engine.requests[-1].prompt_token_ids == [5, 6, 7]
    fake.client().completions.create(model=MODEL, prompt="Hi")
    assert fake.engine.requests[-1].params.max_tokens == 16  # ServerLimits.default_max_tokens, as gRPC
    fake.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    req = fake.engine.requests[-1]
    assert req.params.max_tokens == MAX_MODEL_LEN - len(req.prompt_token_ids)  # chat: the whole context left


def test_chat_renders_the_template_and_tokenizes_without_adding_bos(fake):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = fake.client().chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=40)
    assert r.choices[0].message.content == FULL and r.choices[0].message.role == "assistant"
    assert r.object == "chat.completion" and r.choices[0].finish_reason == "stop"
    rendered = ChatTemplate.compile(CHATML).render(messages)
    expected = make_tokenizer().encode(rendered, add_special_tokens=False).ids
    assert fake.engine.requests[-1].prompt_token_ids == expected and expected[0] != 0  # no BOS added
    assert fake.engine.requests[-1].params.max_tokens == 40


def test_add_special_tokens_is_the_requests_on_both_endpoints(fake):
    """vLLM's add_special_tokens: completions add the tokenizer's (BOS) unless told not to (a client
    that rendered a template itself), chat adds none unless told to."""
    tok = make_tokenizer()
    fake.client().completions.create(model=MODEL, prompt="Hi there", max_tokens=2,
                                     extra_body={"add_special_tokens": False})
    assert fake.engine.requests[-1].prompt_token_ids == tok.encode("Hi there", add_special_tokens=False).ids
    fake.client().completions.create(model=MODEL, prompt="Hi there", max_tokens=2)
    assert fake.engine.requests[-1].prompt_token_ids == tok.encode("Hi there").ids and \
        fake.engine.requests[-1].prompt_token_ids[0] == 0  # BOS
    messages = [{"role": "user", "content": "Hi"}]
    fake.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                          extra_body={"add_special_tokens": True})
    rendered = ChatTemplate.compile(CHATML).render(messages)
    assert fake.engine.requests[-1].prompt_token_ids == tok.encode(rendered).ids


def test_a_logit_bias_past_openais_range_is_clamped_as_vllm_clamps_it(fake):
    fake.client().completions.create(model=MODEL, prompt="a", max_tokens=2,
                                     logit_bias={"5": 1e9, "6": -101, "7": 3.5})
    assert sorted(fake.engine.requests[-1].params.sampling.logit_bias) == [(5, 100.0), (6, -100.0), (7, 3.5)]


def test_numbers_are_read_as_vllms_pydantic_reads_them(fake):
    """A whole float where an integer goes (clients that keep numbers as floats) and numbers or
    booleans written as strings are taken, as vLLM's lax pydantic models take them; a fraction
    where an integer goes, or a number where text goes, is a 400 naming the field."""
    status, _ = fake.request("POST", "/v1/completions", {"prompt": "a", "max_tokens": 5.0, "temperature": "0.5",
                                                         "ignore_eos": "true", "n": 2.0})
    p = fake.engine.requests[-1].params
    assert status == 200 and (p.max_tokens, p.sampling.temperature, p.ignore_eos, p.n) == (5, 0.5, True, 2)
    for body, param in (({"prompt": "a", "max_tokens": 5.5}, "max_tokens"), ({"prompt": "a", "stop": 5}, "stop"),
                        ({"prompt": "a", "n": "two"}, "n")):
        status, raw = fake.request("POST", "/v1/completions", body)
        assert status == 400 and _error(status, raw)["param"] == param


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(fake):
    tok = make_tokenizer()
    ids = tok.encode("the quick brown fox jumps over the lazy dog").ids
    fake.client().completions.create(model=MODEL, prompt="the quick brown fox jumps over the lazy dog", max_tokens=2,
                                     extra_body={"truncate_prompt_tokens": 3})
    assert fake.engine.requests[-1].prompt_token_ids == ids[-3:]
    fake.client().completions.create(model=MODEL, prompt=list(range(5, 30)), max_tokens=2,
                                     extra_body={"truncate_prompt_tokens": -1})  # vLLM's "up to max_model_len"
    assert fake.engine.requests[-1].prompt_token_ids == list(range(5, 30))
    with pytest.raises(openai.BadRequestError) as e:
        fake.client().completions.create(model=MODEL, prompt="a", extra_body={"truncate_prompt_tokens": 257})
    assert e.value.body["param"] == "truncate_prompt_tokens" and "max_model_len=256" in e.value.message
    # token ids past the context are cut first, as vLLM cuts them, then held to it
    long = [i % 290 + 5 for i in range(400)]  # 400 ids of a 300-token vocabulary, past the 256 of the context
    fake.client().completions.create(model=MODEL, prompt=long, max_tokens=2, extra_body={"truncate_prompt_tokens": 100})
    assert fake.engine.requests[-1].prompt_token_ids == long[-100:]
    fake.client().completions.create(model=MODEL, prompt=[long, [7, 8, 9]], max_tokens=2,
                                     extra_body={"truncate_prompt_tokens": 2})
    assert [r.prompt_token_ids for r in fake.engine.requests[-2:]] == [long[-2:], [8, 9]]
    with pytest.raises(openai.BadRequestError) as e:
        fake.client().completions.create(model=MODEL, prompt=long, max_tokens=2)
    assert e.value.code == "context_length_exceeded"


def test_an_echo_of_a_cut_prompt_is_what_the_model_read(fake):
    tok = make_tokenizer()
    text = "the quick brown fox jumps over the lazy dog"
    r = fake.client().completions.create(model=MODEL, prompt=text, max_tokens=2, echo=True,
                                         extra_body={"truncate_prompt_tokens": 3})
    assert r.choices[0].text.startswith(tok.decode(tok.encode(text).ids[-3:]))
    assert not r.choices[0].text.startswith("the quick")


def test_cache_salt_and_the_fields_without_effect_reach_the_engine_as_sent(fake):
    """cache_salt is carried to the engine (which roots the request's block hashes in it); priority
    0, spaces_between_special_tokens and guided_decoding_backend change nothing here and are taken."""
    fake.client().completions.create(model=MODEL, prompt="a", max_tokens=2, extra_body={
        "cache_salt": "tenant-a-secret", "priority": 0, "spaces_between_special_tokens": False,
        "guided_decoding_backend": "xgrammar"})
    assert fake.engine.requests[-1].cache_salt == "tenant-a-secret"
    fake.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=2)
    assert fake.engine.requests[-1].cache_salt is None


def test_documents_reach_the_chat_template(fake, monkeypatch):
    """vLLM's documents: a RAG template (Command-R's, Granite's) reads them. The fake's ChatML
    template does not, so what the front hands its template is watched, and the renderer is
    checked with a template that reads them."""
    seen, render = [], ChatTemplate.render
    monkeypatch.setattr(ChatTemplate, "render", lambda self, *a, **kw: seen.append(a[5:]) or render(self, *a, **kw))
    docs = [{"title": "t", "text": "x"}]
    fake.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "a"}], max_tokens=2,
                                          extra_body={"documents": docs})
    assert seen == [(docs,)]
    rag = ChatTemplate.compile("{% for d in documents %}[{{ d.title }}: {{ d.text }}]{% endfor %}"
                               "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert rag.render([{"role": "user", "content": "q"}], documents=[{"title": "a", "text": "b"}]) == "[a: b]q"


def test_text_input_text_and_refusal_parts_are_read_as_text(fake):
    """A history replayed as the API returned it: an assistant's refusal part is its text, and the
    Responses API's input_text is a text part, as vLLM reads them."""
    parted = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
              {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]},
              {"role": "user", "content": [{"type": "text", "text": "Why"}, {"type": "text", "text": "not?"}]}]
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "I can't."},
             {"role": "user", "content": "Why\nnot?"}]
    fake.client().chat.completions.create(model=MODEL, messages=parted, max_tokens=2)
    fake.client().chat.completions.create(model=MODEL, messages=plain, max_tokens=2)
    assert fake.engine.requests[-2].prompt_token_ids == fake.engine.requests[-1].prompt_token_ids


def test_chat_continue_final_message_renders_the_last_message_open(fake):
    """vLLM's continue_final_message (an assistant prefill): the prompt ends with the final message's
    text, without the template's end-of-turn, so the model continues it; with add_generation_prompt
    true as well it is a 400 naming the field, as in vLLM."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I am"}]
    fake.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=5, extra_body={
        "continue_final_message": True, "add_generation_prompt": False})
    rendered = ChatTemplate.compile(CHATML).render(messages, add_generation_prompt=False)
    prefix = rendered[:rendered.rindex("Hello, I am") + len("Hello, I am")]
    assert fake.engine.requests[-1].prompt_token_ids == make_tokenizer().encode(prefix, add_special_tokens=False).ids
    with pytest.raises(openai.BadRequestError) as e:
        fake.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                              extra_body={"continue_final_message": True})
    assert "continue_final_message" in e.value.message and "add_generation_prompt" in e.value.message
    assert e.value.body["param"] == "continue_final_message"


def test_chat_template_kwargs_reach_the_template_and_a_reserved_name_is_a_400(fake):
    """vLLM's chat_template_kwargs: more variables for the model's template (here one the template
    does not read, so the prompt is unchanged); one that would replace the server's own is refused."""
    messages = [{"role": "user", "content": "Hi"}]
    fake.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                          extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    rendered = ChatTemplate.compile(CHATML).render(messages)
    assert fake.engine.requests[-1].prompt_token_ids == make_tokenizer().encode(rendered, add_special_tokens=False).ids
    with pytest.raises(openai.BadRequestError) as e:
        fake.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                              extra_body={"chat_template_kwargs": {"messages": []}})
    assert e.value.body["param"] == "chat_template_kwargs"
    assert "chat_template_kwargs.messages: is set by the server" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:
        fake.client().chat.completions.create(model=MODEL, messages=messages, max_tokens=5,
                                              extra_body={"chat_template_kwargs": ["enable_thinking"]})
    assert e.value.body["param"] == "chat_template_kwargs"


def test_chat_stream_role_first_usage_last_then_done(fake):
    stream = fake.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == FULL
    assert chunks[-2].choices[0].finish_reason == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.usage is None for c in chunks[:-1])


def test_n_choices_stop_logprobs_and_extensions_reach_the_engine(fake):
    r = fake.client().completions.create(
        model=MODEL, prompt="Hi", n=2, stop=["the"], logprobs=2, seed=7, temperature=0.5, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=-0.5,
        extra_body={"top_k": 5, "min_p": 0.1, "repetition_penalty": 1.2, "ignore_eos": True,
                    "stop_token_ids": [9], "return_token_ids": True})
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.text == "Hello world, " and c.finish_reason == "stop" for c in r.choices)  # cut before "the"
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert len(r.choices[0].token_ids) == len(lp.tokens)  # return_token_ids
    p = fake.engine.requests[-1].params
    s = p.sampling
    assert (p.n, p.stop, p.stop_token_ids, p.ignore_eos) == (2, ["the"], [9], True)
    assert (s.seed, s.temperature, s.top_k, s.logprobs, s.want_logprobs) == (7, 0.5, 5, 2, True)
    assert (s.presence_penalty, s.frequency_penalty) == (0.5, -0.5)
    assert s.top_p == pytest.approx(0.9) and s.min_p == pytest.approx(0.1) and s.repetition_penalty == 1.2


@pytest.mark.parametrize("path,stop,reason", [
    ("/v1/completions", ["the"], "the"), ("/v1/completions", [], None),
    ("/v1/chat/completions", ["the"], "the"), ("/v1/chat/completions", [], None)])
def test_stop_reason_names_the_stop_string_that_ended_a_choice_as_vllm_does(fake, path, stop, reason):
    body = {"max_tokens": 50, "stop": stop, **({"prompt": "Hi"} if "chat" not in path else
                                                {"messages": [{"role": "user", "content": "Hi"}]})}
    status, raw = fake.request("POST", path, body)
    choice = json.loads(raw)["choices"][0]
    assert (status, choice["finish_reason"], choice["stop_reason"]) == (200, "stop", reason)  # (EOS: null)
    status, raw = fake.request("POST", path, {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]
    ends = [c["choices"][0] for c in chunks if c["choices"][0].get("finish_reason")]
    assert [(e["finish_reason"], e["stop_reason"]) for e in ends] == [("stop", reason)]
    assert all("stop_reason" not in c["choices"][0] for c in chunks if not c["choices"][0].get("finish_reason"))


@pytest.mark.parametrize("seed,sent", [(-1, 2**64 - 1), (-(2**63), 2**63), (2**64 - 1, 2**64 - 1), (0, 0)])
def test_any_int64_seed_is_taken_as_vllm_takes_it_a_negative_one_as_its_64_bits(fake, seed, sent):
    # UIs send seed -1; vLLM takes any int64. gRPC's seed is a uint64: -1 is the same 64 bits as 2**64 - 1.
    fake.client().completions.create(model=MODEL, prompt="Hi", seed=seed)
    assert fake.engine.requests[-1].params.sampling.seed == sent


def test_chat_logprobs_form_and_beam_search_mapping(fake):
    r = fake.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                              logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert content and all(len(e.top_logprobs) == 2 for e in content)
    assert all(bytes(e.bytes).decode("utf-8", "replace") == e.token for e in content)
    assert fake.engine.requests[-1].params.sampling.logprobs == 2
    fake.client().completions.create(model=MODEL, prompt="Hi", n=3, extra_body={"use_beam_search": True})
    p = fake.engine.requests[-1].params
    assert (p.n, p.beam_width) == (1, 3)


@pytest.mark.parametrize("path,kind,body", [
    ("/v1/completions", CompletionRequest, {"prompt": "Hi"}),
    ("/v1/chat/completions", ChatRequest, {"messages": [{"role": "user", "content": "Hi"}]}),
])
def test_null_in_any_optional_field_means_its_default(fake, path, kind, body):
    """OpenAI's "or null" fields (and vLLM's extensions): null is the default, never a 400."""
    status, raw = fake.request("POST", path, body)
    assert status == 200, raw
    expected = fake.engine.requests[-1]
    nulls = {f.name: None for f in msgspec.structs.fields(kind) if f.name not in body}
    assert {"stream", "logprobs", "n", "temperature", "stop", "skip_special_tokens"} <= set(nulls)
    status, raw = fake.request("POST", path, {**body, **nulls})
    assert status == 200, raw
    got = fake.engine.requests[-1]
    assert got.params == expected.params and got.prompt_token_ids == expected.prompt_token_ids
    assert json.loads(raw)["object"] in ("text_completion", "chat.completion")  # stream: null is not a stream
    assert "logprobs" not in json.dumps(json.loads(raw)["choices"][0]).replace('"logprobs": null', "")


def test_null_inside_messages_and_stream_options_means_the_default(fake):
    status, raw = fake.request("POST", "/v1/chat/completions", {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]},
                     {"role": "assistant", "content": "Calling f.", "tool_calls": [
                         {"id": "c1", "type": None, "function": {"name": "f", "arguments": None}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "ok"}],
        "stream": True, "stream_options": {"include_usage": None, "continuous_usage_stats": None}})
    assert status == 200, raw
    events = [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: {")]
    assert events and all("usage" not in e for e in events)  # include_usage: null is false


TOOL_ROUND = [{"role": "user", "content": "weather?"},
              {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
                  "name": "get_weather", "arguments": "{\"city\":\"Paris\"}"}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]


def test_a_reply_that_called_a_tool_goes_back_in_the_history_with_null_content(fake):
    """What the openai SDK sends when a client appends ``reply.choices[0].message``: content null."""
    rendered = ("<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n<|im_end|>\n"
                "<|im_start|>tool\nsunny<|im_end|>\n<|im_start|>assistant\n")
    expected = make_tokenizer().encode(rendered, add_special_tokens=False).ids
    r = fake.client().chat.completions.create(model=MODEL, messages=TOOL_ROUND)
    assert r.choices[0].message.content == FULL and fake.engine.requests[-1].prompt_token_ids == expected
    status, raw = fake.request("POST", "/tokenize", {"messages": TOOL_ROUND})
    assert status == 200 and json.loads(raw)["tokens"] == expected


def test_batch_of_prompts_runs_one_request_each_with_echo(fake):
    r = fake.client().completions.create(model=MODEL, prompt=["Hi", "Ho"], n=2, echo=True, max_tokens=3)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text[:2] for c in r.choices] == ["Hi", "Hi", "Ho", "Ho"]
    assert len(fake.engine.requests) == 2 and len({q.request_id for q in fake.engine.requests}) == 2
    assert r.usage.prompt_tokens == sum(len(q.prompt_token_ids) for q in fake.engine.requests)


def test_a_large_body_is_validated_and_its_echo_decoded_off_the_event_loop(fake, monkeypatch):
    class Watched:  # the front's tokenizer, noting the thread of every call
        def __init__(self, tok) -> None:
            self.tok, self.threads = tok, set()

        def __getattr__(self, name):
            self.threads.add(threading.get_ident())
            return getattr(self.tok, name)

    async def ident() -> int:
        return threading.get_ident()

    watched = Watched(fake.front.tokenizer)
    monkeypatch.setattr(fake.front, "tokenizer", watched)
    monkeypatch.setattr(offload, "THREAD_CHARS", 64)  # this fixture's bodies stay under 4 KB
    ids = list(range(5, 105))  # more ids than THREAD_CHARS below: the echo decode is real work
    r = fake.client().completions.create(model=MODEL, prompt=ids, echo=True, max_tokens=3)
    assert r.choices[0].text.startswith(watched.tok.decode(ids))  # the echo, then the completion
    assert fake.engine.requests[0].prompt_token_ids == ids
    assert watched.threads and fake.call(ident()) not in watched.threads  # never the loop's thread


def test_token_id_prompts_do_not_queue_behind_long_text_prompts(fake, monkeypatch):
    """The worker slots are for tokenizer work: with both held (two huge text prompts being
    tokenized), a batch of token-id prompts is still served; a long text prompt waits."""
    monkeypatch.setattr(offload, "THREAD_CHARS", 64)  # this fixture's bodies stay under 4 KB

    async def hold(n: int) -> list:
        slots = offload._slots.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(offload.CONCURRENT))
        for _ in range(n):
            await slots.acquire()
        return [slots] * n

    held = fake.call(hold(offload.CONCURRENT))
    try:
        ids = [list(range(5, 105)), list(range(7, 107))]  # a body of ~1 KB: "large" here
        r = fake.client(timeout=5).completions.create(model=MODEL, prompt=ids, max_tokens=3)
        assert len(r.choices) == 2 and [q.prompt_token_ids for q in fake.engine.requests] == ids
        with pytest.raises(openai.APITimeoutError):  # text to tokenize: it needs a slot
            fake.client(timeout=1).completions.create(model=MODEL, prompt="word " * 40, max_tokens=3)
    finally:
        for slots in held:
            fake.loop.call_soon_threadsafe(slots.release)


def test_models_and_health(fake):
    (model,) = fake.client().models.list().data
    assert model.id == MODEL and model.owned_by == "pagedserve"
    assert fake.client().models.retrieve(MODEL).id == MODEL
    assert fake.request("GET", "/health")[0] == 200
    assert fake.request("GET", "/ping")[0] == fake.request("POST", "/ping")[0] == 200  # vLLM's probe
    fake.engine.ready = False
    assert fake.request("GET", "/health")[0] == fake.request("GET", "/ping")[0] == 503


# ------------------------------------------------------------------ errors

BAD = [
    ("/v1/completions", {"prompt": "a", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "a", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 10**6}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "a", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "a", "n": 5}, "n"),
    ("/v1/completions", {"prompt": "a", "n": 9, "use_beam_search": True}, "n"),
    ("/v1/completions", {"prompt": "a", "stop": [""]}, "stop"),
    ("/v1/completions", {"prompt": "a", "stop": ["a", "b", "c"]}, "stop"),
    ("/v1/completions", {"prompt": "a", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": "a", "seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", {"prompt": "a", "top_k": -2}, "top_k"),
    ("/v1/completions", {"prompt": "a", "stop_token_ids": [10**6]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [1, 10**6]}, "prompt"),
    ("/v1/completions", {"prompt": ["a", "b", "c"]}, "prompt"),
    ("/v1/completions", {"prompt": ["a", [1]]}, "prompt"),
    ("/v1/completions", {"max_tokens": 3}, "prompt"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"x": 10}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "logit_bias": {"999999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "a", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("/v1/completions", {"prompt": "a", "prompt_logprobs": 6}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "json_schema"}}, "response_format"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "json_schema",
                                                            "json_schema": {"schema": {"type": "foo"}}}},
     "response_format"),
    ("/v1/completions", {"prompt": "a", "response_format": {"type": "yaml"}}, "response_format"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"regex": "a", "choice": ["b"]}},
     "structured_outputs"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"grammar": "root ::= missing"}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"choice": []}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"structural_tag": {}}}, "structured_outputs"),
    ("/v1/completions", {"prompt": "a", "structured_outputs": {"json_object": True}, "ignore_eos": True},
     "structured_outputs"),
    ("/v1/completions", {"prompt": "a", "guided_regex": "a", "response_format": {"type": "json_object"}},
     "guided_regex"),
    ("/v1/completions", {"prompt": "a", "guided_json": {"type": "object", "properties": {
        "a": {"type": "integer", "minimum": 5, "maximum": 1}}}}, "guided_json"),
    ("/v1/completions", {"prompt": "a", "use_beam_search": True, "n": 2, "guided_choice": ["x"]}, "guided_choice"),
    ("/v1/completions", {"prompt": "a", "suffix": "x"}, "suffix"),
    ("/v1/completions", {"prompt": "a", "use_beam_search": True, "n": 2, "logprobs": 0}, "logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "use_beam_search": True, "n": 2,
                              "logprobs": True}, "logprobs"),
    # vLLM's fields that would change the output and are not implemented: refused, never dropped
    ("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ("/v1/completions", {"prompt": "a", "priority": 1}, "priority"),
    ("/v1/completions", {"prompt": "a", "cache_salt": ""}, "cache_salt"),
    ("/v1/completions", {"prompt": "a", "cache_salt": "s" * 1025}, "cache_salt"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "cache_salt": 5}, "cache_salt"),
    ("/v1/completions", {"prompt": "a", "vllm_xargs": {"k": 1}}, "vllm_xargs"),
    ("/v1/completions", {"prompt": "a", "logits_processors": ["x"]}, "logits_processors"),
    ("/v1/completions", {"prompt": "a", "guided_whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "documents": "notalist"}, "documents"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "documents": [1, 2]}, "documents"),
    ("/v1/completions", {"prompt": "a", "allowed_token_ids": [5]}, "allowed_token_ids"),
    ("/v1/completions", {"prompt": "a", "bad_words": ["the"]}, "bad_words"),
    ("/v1/completions", {"prompt": "a", "logprobs": 1, "return_tokens_as_token_ids": True},
     "return_tokens_as_token_ids"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "echo": True}, "echo"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "chat_template": "{{ 1 }}"},
     "chat_template"),
    ("/v1/completions", {"prompt": "a", "stream_options": {"include_usage": True}}, "stream_options"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}] * 4}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "a"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user"}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a " * 300}]}, "messages"),  # > 256 tokens
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 999},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "logprobs": True,
                              "top_logprobs": 6}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]},
     "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"},
     "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [TOOL]}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [TOOL],
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [TOOL, TOOL],
                              "tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [
        {"type": "function", "function": {"name": "bad name!"}}], "tool_choice": "required"}, "tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "tools": [TOOL],
                              "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{"}}]}]}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, "messages"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{p.split('/')[-1]}-{i}" for i, (p, _, _) in enumerate(BAD)])
def test_bad_input_is_400_naming_the_openai_field(fake, path, body, param):
    status, raw = fake.request("POST", path, body)
    err = _error(status, raw)
    assert status == 400 and err["param"] == param and err["type"] == "invalid_request_error", err
    assert err["message"].startswith(param), err  # "<field>: <what is wrong> (got <value>)"
    assert not fake.engine.requests


def test_validation_message_names_limit_and_value(fake):
    err = _error(*fake.request("POST", "/v1/completions", {"prompt": "a", "n": 5}))
    assert err["message"] == "n: must be in [1, 4] (got 5)"  # (0 is refused: "n: must be >= 1")
    with pytest.raises(openai.BadRequestError) as e:
        fake.client().completions.create(model=MODEL, prompt="a", temperature=-1)
    assert e.value.status_code == 400 and e.value.body["param"] == "temperature"


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_length_overflow_names_only_the_field_the_client_sent(fake, field):
    err = _error(*fake.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}],
                                                                field: 999}))
    assert err["param"] == field and err["code"] == "context_length_exceeded", err
    # OpenAI's sentence (clients that trim a conversation look for it), with the field the client sent
    assert err["message"].startswith(f"{field}: This model's maximum context length is 256 tokens. However, you "
                                     "requested "), err
    assert "999 in the completion" in err["message"] and ("max_tokens" in err["message"]) == (field == "max_tokens"), err


def test_a_prompt_past_the_context_is_context_length_exceeded_as_openai_says_it(fake):
    """The code and sentence OpenAI uses (LiteLLM's ContextWindowExceededError, LangChain's trimming
    read one or the other), for a prompt alone too long and for one too long with its max_tokens."""
    for body in ({"prompt": [5] * 256}, {"prompt": [5] * 250, "max_tokens": 7}):
        with pytest.raises(openai.BadRequestError) as e:
            fake.client().completions.create(model=MODEL, **body)
        assert e.value.code == "context_length_exceeded", e.value.body
        assert "This model's maximum context length is 256 tokens" in e.value.message


@pytest.mark.parametrize("path,body,message,code", [
    ("/v1/completions", b'{"prompt": "a", "n": 1000}', "n: must be in [1, 4] (got 1000)", "invalid_value"),
    ("/v1/completions", b'{"prompt": "a", "n": 0}', "n: must be >= 1 (got 0)", "invalid_value"),
    ("/v1/completions", b'{"prompt": "a", "top_k": -2}',
     "top_k: must be -1 or 0 (off) or in [1, 2147483647] (got -2)", "invalid_value"),
    ("/v1/completions", b'{"prompt": "a", "n": 9, "use_beam_search": true}', "n: must be in [1, 8] (got 9)",
     "invalid_value"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text"}]}]}',
     "messages[0].content[0].text: is required in a part of type 'text'", "missing_required_parameter"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}',
     "messages[0].content[0]: only text parts are supported: text, input_text, refusal (got type 'image_url')",
     "unsupported"),
    ("/v1/chat/completions", b'{"messages": [{"role": "assistant", "content": [{"type": "refusal"}]}]}',
     "messages[0].content[0].refusal: is required in a part of type 'refusal'", "missing_required_parameter"),
    ("/v1/completions", b'{"prompt": "a", "temperature": 1e400}',
     "temperature: must be a number of at most 1.8e+308 in magnitude (a 64-bit float)", "invalid_value"),
    ("/v1/completions", b'{"prompt": "a", "logit_bias": {"5": -1e400}}',
     "logit_bias[...]: must be a number of at most 1.8e+308 in magnitude (a 64-bit float)", "invalid_value"),
])
def test_error_messages_name_the_field_and_its_limit(fake, path, body, message, code):
    err = _error(*fake.request("POST", path, body))
    assert (err["message"], err["code"]) == (message, code)
    assert err["param"] == message.split(":")[0].split("[")[0]


@pytest.mark.parametrize("key", ["-1", "²", "٣", "1" * 20, "", " 5", "5e0"])
def test_a_logit_bias_key_that_is_not_ascii_digits_is_a_400_never_a_500_or_another_token(fake, key):
    # int() takes "٣" as 3 and raises on "²" (and on 4,301 digits): a 500, which the openai client retries.
    status, raw = fake.request("POST", "/v1/completions", {"prompt": "a", "logit_bias": {key: 1}})
    assert (status, json.loads(raw)) == (400, {"error": {
        "message": f"logit_bias: keys must be token ids, decimal integers of at most 19 digits (got {key[:40]!r})",
        "type": "invalid_request_error", "param": "logit_bias", "code": "invalid_value"}})
    assert not fake.engine.requests
    fake.client().completions.create(model=MODEL, prompt="a", logit_bias={"0000000000000000005": 1})
    assert fake.engine.requests[-1].params.sampling.logit_bias == [(5, 1.0)]


@pytest.mark.parametrize("prompt,message", [
    ([[1, 99999]], "prompt[0][1]: must be a token id in [0, vocab_size=300) (got 99999)"),  # was "prompt[1]"
    ([[1, 2], [3, 99999]], "prompt[1][1]: must be a token id in [0, vocab_size=300) (got 99999)"),
    ([1, 99999], "prompt[1]: must be a token id in [0, vocab_size=300) (got 99999)"),
    (["a", ""], "prompt[1]: must not be empty (got '')"),
    ([""], "prompt[0]: must not be empty (got '')"),  # was "prompt: ..."
])
def test_an_error_in_a_list_of_prompts_names_the_prompt_even_when_there_is_one(fake, prompt, message):
    err = _error(*fake.request("POST", "/v1/completions", {"prompt": prompt}))
    assert (err["message"], err["param"]) == (message, "prompt")


def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth  # `depth` levels of lists


@pytest.mark.parametrize("arguments", [_nested(1100), _nested(65), json.loads('{"a": ' * 65 + "1" + "}" * 65)])
def test_tool_call_arguments_nested_too_deeply_are_a_400_never_a_500(fake, arguments):
    # json.loads raised RecursionError past ~1,000 levels: a 500, which the openai client retries twice.
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
    body = {"messages": [{"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "user", "content": "a"}]}
    status, raw = fake.request("POST", "/v1/chat/completions", body)
    assert (status, json.loads(raw)) == (400, {"error": {
        "message": "messages[0].tool_calls[0].function.arguments: is nested more than 64 levels deep",
        "type": "invalid_request_error", "param": "messages", "code": "invalid_value"}})
    assert not fake.engine.requests
    call["function"]["arguments"] = _nested(64)
    fake.client().chat.completions.create(model=MODEL, messages=body["messages"])
    assert len(fake.engine.requests) == 1


def _response_head(fake, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", fake.server.port, timeout=10)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **headers})
        resp = conn.getresponse()
        resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}
    finally:
        conn.close()


@pytest.mark.parametrize("method,path,body,status", [
    ("POST", "/v1/completions", b'{"prompt": "Hi"}', 200),
    ("POST", "/v1/completions", b'{"prompt": "Hi", "stream": true}', 200),
    ("POST", "/v1/completions", b'{"prompt": "Hi", "n": 0}', 400),
    ("POST", "/v1/completions", b"x" * 5000, 413),
    ("GET", "/v1/nothing", None, 404),
    ("GET", "/v1/models", None, 200),
])
def test_every_response_carries_the_clients_x_request_id_or_a_fresh_one(fake, method, path, body, status):
    # OpenAI answers x-request-id (the openai client's `_request_id`); vLLM echoes the client's X-Request-Id.
    got, headers = _response_head(fake, method, path, body, {"X-Request-Id": "trace-42/a.b"})
    assert (got, headers["x-request-id"]) == (status, "trace-42/a.b")
    fresh = [_response_head(fake, method, path, body, h)[1]["x-request-id"]
             for h in ({}, {}, {"X-Request-Id": "two words"}, {"X-Request-Id": "x" * 257})]
    assert all(len(f) == 32 and int(f, 16) >= 0 for f in fresh) and len(set(fresh)) == 4  # never an echo of those


def test_the_openai_client_reads_the_request_id_it_sent(fake):
    r = fake.client().completions.create(model=MODEL, prompt="Hi", extra_headers={"X-Request-Id": "mine-1"})
    assert r._request_id == "mine-1"


def test_malformed_and_oversized_bodies(fake):
    status, raw = fake.request("POST", "/v1/completions", b'{"prompt": "a",')
    assert status == 400 and _error(status, raw)["code"] == "invalid_json"
    status, raw = fake.request("POST", "/v1/completions", b'{"prompt": ' + b"[" * 2000 + b"]" * 2000 + b"}")
    assert status == 400
    status, raw = fake.request("POST", "/v1/completions", {"prompt": "a" * 5000})
    assert status == 413 and _error(status, raw)["code"] == "request_too_large"


@pytest.mark.parametrize("headers,param,got", [
    ({"Content-Type": "text/plain"}, "content-type", "'text/plain'"),
    ({"Content-Type": "application/x-www-form-urlencoded"}, "content-type", "'application/x-www-form-urlencoded'"),
    ({"Content-Type": "application/json", "Content-Encoding": "gzip"}, "content-encoding", "'gzip'"),
])
def test_a_body_that_is_not_plain_json_is_415_naming_the_header(fake, headers, param, got):
    # Decoded as JSON by guess, a gzip body was a confusing "invalid JSON" 400; vLLM refuses any type but JSON.
    status, raw = fake.request("POST", "/v1/completions", b'{"prompt": "Hi"}', headers)
    err = _error(status, raw)
    assert (status, err["param"], err["code"]) == (415, param, "unsupported_media_type")
    assert got in err["message"] and not fake.engine.requests


@pytest.mark.parametrize("headers", [{"Accept": "*/*"},  # (no Content-Type at all)
                                     {"Content-Type": "application/json; charset=utf-8"},
                                     {"Content-Type": "Application/JSON"}, {"Content-Encoding": "identity"}])
def test_json_bodies_are_served_with_or_without_a_content_type(fake, headers):
    assert fake.request("POST", "/v1/completions", b'{"prompt": "Hi"}', headers)[0] == 200
    assert len(fake.engine.requests) == 1


def test_a_body_of_another_media_type_is_refused_before_it_is_read(fake):
    with socket.create_connection(("127.0.0.1", fake.server.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: text/plain\r\n"
                  b"Content-Length: 100\r\n\r\n{")  # the rest never comes: answered all the same
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 415")


def test_oversized_body_is_refused_from_its_content_length_before_it_is_read(fake):
    with socket.create_connection(("127.0.0.1", fake.server.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 1000000000\r\n\r\n{")  # a gigabyte announced, one byte sent
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413")


def test_chunked_body_is_cut_off_at_the_limit(fake):
    with socket.create_connection(("127.0.0.1", fake.server.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"x" * 1000
        for _ in range(5):  # 5000 bytes > 4096, no Content-Length to refuse it by
            s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
        reply = s.recv(4096)
    assert reply.startswith(b"HTTP/1.1 413")


def test_an_endless_request_head_is_cut_off_and_the_server_keeps_serving(fake):
    """httptools (llhttp) does not bound a head: a header value sent forever would be buffered
    forever. The connection gets 400 and is closed once the head passes 16 KiB, as with h11."""
    from scheduler_svc.front.http.serve import MAX_REQUEST_HEAD_BYTES, BoundedHttpToolsProtocol

    assert fake.server.server.config.http_protocol_class.func is BoundedHttpToolsProtocol
    with socket.create_connection(("127.0.0.1", fake.server.port), timeout=5) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Endless: ")
        sent, reply = 0, b""
        with contextlib.suppress(OSError):  # (the server may close while we still send)
            while sent < 40 * MAX_REQUEST_HEAD_BYTES and not reply:
                s.sendall(b"a" * 4096)
                sent += 4096
                s.settimeout(0.01)
                with contextlib.suppress(TimeoutError):
                    reply = s.recv(4096)
                s.settimeout(5)
        reply += s.recv(4096) if not reply else b""
    assert reply.startswith(b"HTTP/1.1 400") and b"head too large" in reply
    assert sent <= 2 * MAX_REQUEST_HEAD_BYTES  # cut off near the bound, not after buffering it all
    assert fake.client().completions.create(model=MODEL, prompt="a").choices[0].text == FULL


def test_a_large_body_sent_with_its_head_is_not_counted_as_head(fake):
    """The head bound counts only what precedes the end of the headers, even when the body
    arrives in the same read."""
    body = json.dumps({"prompt": "a", "model": MODEL, "user": "u" * 3000}).encode()  # < max_body_bytes
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + b"X-Pad: " + b"p" * 12000 + b"\r\n"  # head 12 KB + body 3 KB > 16 KiB together
            + b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))
    with socket.create_connection(("127.0.0.1", fake.server.port), timeout=5) as s:
        s.sendall(head + body)
        reply = b""
        while chunk := s.recv(65536):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200"), reply[:200]


def test_an_empty_model_names_the_served_one_as_in_vllm(fake):
    r = fake.client().completions.create(model="", prompt="Hello", max_tokens=3)
    assert r.model == MODEL and fake.engine.requests[-1].lora is None


def test_unknown_model_route_and_method(fake):
    with pytest.raises(openai.NotFoundError) as e:
        fake.client().completions.create(model="gpt-4", prompt="a")
    assert e.value.body["code"] == "model_not_found" and e.value.body["param"] == "model"
    status, raw = fake.request("GET", "/v2/nothing")
    assert status == 404 and _error(status, raw)["code"] == "not_found"
    assert fake.request("GET", "/v1/completions")[0] == 405
    assert fake.request("GET", "/v1/models/gpt-4")[0] == 404


@pytest.mark.parametrize("mode,status,error", [("queue_full", 429, openai.RateLimitError),
                                                ("no_executor", 503, openai.InternalServerError),
                                                ("crash", 500, openai.InternalServerError)])
def test_engine_errors_map_to_statuses_and_the_server_keeps_serving(fake, mode, status, error):
    fake.engine.mode = mode
    with pytest.raises(error) as e:
        fake.client().completions.create(model=MODEL, prompt="a")
    assert e.value.status_code == status
    # Streaming: raised before the first output, the status is still the error's; a crash after
    # it comes as an error event (the openai client raises it as APIError).
    with pytest.raises(error if mode != "crash" else openai.APIError) as e:
        list(fake.client().completions.create(model=MODEL, prompt="a", stream=True))
    assert getattr(e.value, "status_code", None) == (status if mode != "crash" else None)
    fake.engine.mode = "ok"
    assert fake.client().completions.create(model=MODEL, prompt="a").choices[0].text == FULL


def test_error_after_the_stream_started_is_an_error_event_then_done(fake):
    fake.engine.mode = "fail"
    status, raw = fake.request("POST", "/v1/completions", {"prompt": "a", "stream": True})
    events = [e for e in raw.decode().split("\n\n") if e]
    assert status == 200 and events[-1] == "data: [DONE]"
    assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == "request_failed"


def test_rejections_are_counted_with_the_grpc_code_names(fake):
    before = fake.metrics.rejected.labels("INVALID_ARGUMENT")._value.get()
    fake.request("POST", "/v1/completions", {"prompt": "a", "n": 0})
    assert fake.metrics.rejected.labels("INVALID_ARGUMENT")._value.get() == before + 1


def test_a_client_gone_mid_upload_is_counted_cancelled_not_an_internal_error(fake, caplog):
    import socket
    import time

    before = fake.metrics.rejected.labels("CANCELLED")._value.get()
    with socket.create_connection(("127.0.0.1", fake.server.port), timeout=5) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"prompt\": \"a")  # then hangs up, 988 bytes short
    deadline = time.monotonic() + 5
    while fake.metrics.rejected.labels("CANCELLED")._value.get() == before:
        assert time.monotonic() < deadline, "the abandoned upload was never accounted for"
        time.sleep(0.02)
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert fake.client().completions.create(model=MODEL, prompt="a").choices[0].text == FULL


def test_a_body_trickled_past_the_time_limit_is_408_and_the_server_keeps_serving():
    import socket

    engine = FakeEngine(make_tokenizer(), MAX_MODEL_LEN)
    engine.ready = True
    http = HttpThread(engine, ChatTemplate.compile(CHATML), LIMITS, HttpLimits(body_timeout_s=1), Metrics())
    try:
        with socket.create_connection(("127.0.0.1", http.server.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")  # and nothing more
            reply = b""
            while b"request_timeout" not in reply and (chunk := sock.recv(4096)):  # headers, body: 1-2 reads
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 408") and b"request_timeout" in reply
        assert http.client().completions.create(model=MODEL, prompt="a").choices[0].text == FULL
    finally:
        http.stop()


def _read_response(sock) -> tuple[int, bytes]:
    """One HTTP/1.1 response with a Content-Length from a keep-alive socket: (status, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(65536)
    return int(head.split()[1]), body


def _trickle_head(sock) -> bytes:
    """Send a request head one byte every 0.2 s, never finishing it; what the server answers
    before it closes the connection (at most 5 s)."""
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\n")
    reply, start = b"", time.monotonic()
    with contextlib.suppress(OSError):  # (the server may close while we still send)
        while not reply and time.monotonic() - start < 5:
            sock.sendall(b"X")
            sock.settimeout(0.2)
            with contextlib.suppress(TimeoutError):
                reply = sock.recv(4096)
    sock.settimeout(5)
    # A byte we sent after the server closed makes its kernel answer with a reset: the end, as EOF.
    with contextlib.suppress(ConnectionResetError):
        while chunk := sock.recv(4096):
            reply += chunk
    return reply


def test_a_head_sent_slowly_or_never_is_timed_out_and_the_server_keeps_serving():
    """uvicorn bounds neither: any byte resets its keep-alive timer, and a new connection may wait
    for ever. A head trickled past head_timeout_s gets 408; a connection that sends nothing is
    closed; a client that sends its head in time (also after idling on keep-alive) is served."""
    import socket

    engine = FakeEngine(make_tokenizer(), MAX_MODEL_LEN)
    engine.ready = True
    http = HttpThread(engine, ChatTemplate.compile(CHATML), LIMITS, HttpLimits(head_timeout_s=1), Metrics())
    try:
        port = http.server.port
        with socket.create_connection(("127.0.0.1", port), timeout=10) as slow, \
                socket.create_connection(("127.0.0.1", port), timeout=10) as silent:
            start = time.monotonic()
            reply = _trickle_head(slow)
            took = time.monotonic() - start
            assert reply.startswith(b"HTTP/1.1 408") and b"not received in time" in reply, reply[:200]
            assert 0.9 < took < 3
            assert silent.recv(4096) == b""  # closed without an answer
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:  # keep-alive: two requests
            body = json.dumps({"prompt": "a", "model": MODEL}).encode()
            head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n" % len(body))
            for i in range(3):
                if i:
                    time.sleep(0.6)  # idle between requests: uvicorn's keep-alive timeout, not ours
                s.sendall(head[:20])
                time.sleep(0.6 if i else 0.3)  # a later head ends 1.2 s after the last response: its
                s.sendall(head[20:] + body)  # clock starts at its first byte
                status, _ = _read_response(s)
                assert status == 200
            assert _trickle_head(s).startswith(b"HTTP/1.1 408")  # a later request's head is timed too
        assert http.client().completions.create(model=MODEL, prompt="a").choices[0].text == FULL
    finally:
        http.stop()


def test_unavailable_before_an_executor_and_while_shutting_down(fake):
    fake.engine.info, fake.front.last_info = None, None  # (as before any executor registered)
    try:
        status, raw = fake.request("POST", "/v1/completions", {"prompt": "a"})
        assert status == 503 and _error(status, raw)["code"] == "no_executor"
        assert fake.request("GET", "/v1/models")[0] == 503
    finally:
        fake.engine.info = FakeEngine(make_tokenizer(), MAX_MODEL_LEN).info
    fake.front.shutting_down = True
    status, raw = fake.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})
    assert status == 503 and _error(status, raw)["code"] == "shutting_down"
    assert fake.request("GET", "/health")[0] == 503
    fake.engine.info = None  # and the model last served is not listed then either
    try:
        assert fake.request("GET", "/v1/models")[0] == 503
    finally:
        fake.engine.info = FakeEngine(make_tokenizer(), MAX_MODEL_LEN).info


def test_chat_without_a_template_is_a_clear_400():
    engine = FakeEngine(make_tokenizer())
    srv = HttpThread(engine, template=None)
    try:
        status, raw = srv.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}]})
        err = _error(status, raw)
        assert status == 400 and err["code"] == "no_chat_template" and "chat template" in err["message"]
        assert srv.client().completions.create(model=MODEL, prompt="a").choices[0].text == FULL
    finally:
        srv.stop()


# ------------------------------------------------------------------ disconnects

def _wait_closed(engine: FakeEngine, timeout_s: float = 5.0) -> tuple[str, bool]:
    assert engine.closed_event.wait(timeout_s), "the engine's generator was never closed"
    return engine.closed[-1]


def test_a_client_leaving_a_stream_closes_the_engine_generator_at_once(fake):
    fake.engine.completions = ["word " * 200]
    fake.engine.token_delay = 0.02
    stream = fake.client().completions.create(model=MODEL, prompt="a", max_tokens=60, stream=True)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    t0 = time.monotonic()
    stream.close()
    _, finished = _wait_closed(fake.engine)
    assert not finished and time.monotonic() - t0 < 1.0  # aborted, long before 60 tokens x 20 ms


def test_a_client_leaving_a_non_streamed_request_closes_the_engine_generator(fake):
    fake.engine.completions = ["word " * 200]
    fake.engine.token_delay = 0.05
    with pytest.raises(openai.APITimeoutError):
        fake.client(timeout=0.3).completions.create(model=MODEL, prompt="a", max_tokens=60)
    _, finished = _wait_closed(fake.engine)
    assert not finished


def test_connections_send_without_nagle_delay(fake):
    """Each SSE event is a small write; with Nagle's algorithm on, every one after the first
    waits for the client's delayed ACK (~40 ms on Linux)."""
    fake.engine.token_delay = 0.05
    stream = fake.client().completions.create(model=MODEL, prompt="a", stream=True)
    next(iter(stream))
    conns = list(fake.server.server.server_state.connections)
    sockets = [c.transport.get_extra_info("socket") for c in conns]
    assert sockets and all(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) for s in sockets)
    stream.close()


def test_a_streamed_response_imports_nothing_on_its_way():
    """The first streamed response after start must not wait for an import (starlette's own
    streaming response imported anyio's asyncio backend then: 20-30 ms)."""
    import subprocess
    import sys

    probe = """
import asyncio, sys
from scheduler_svc.front.http import app, streams
async def events():
    yield b"data: 1\\n\\n"
async def main():
    sent = []
    async def receive():
        await asyncio.sleep(3600)
    async def send(message):
        sent.append(message["type"])
    before = set(sys.modules)
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    await streams.EventStreamResponse(events())(scope, receive, send)
    print(sorted(set(sys.modules) - before), sent)
asyncio.run(main())
"""
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[] ['http.response.start', 'http.response.body', 'http.response.body']"
