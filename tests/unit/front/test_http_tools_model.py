"""Structured outputs and tool calls through the whole serving path, in one process: the official
openai client, the HTTP front (one per chat template: Llama-3.1-, Hermes/Qwen- and Mistral-style),
the engine, and an executor running the tiny random-weight model with the grammar on its sampler.

A random model never chooses to call a tool, so ``tool_choice`` here is ``required`` or a named
function, which a grammar enforces: the arguments must always parse and match the tool's schema.
(``auto``'s parsing of what a model writes is tests/unit/front/test_http_structured.py's, on scripted text.)
"""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from tokenizers import Tokenizer

from scheduler_svc.front.tool_calls import ToolCallOptions
from testing.real_model_front import RealModelFront
from testing.tool_templates import TEMPLATES, TOOLS, history

pytestmark = pytest.mark.slow
EOS = 0
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 10},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 50},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3}},
          "required": ["name", "n", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module")
def served(tiny_llama_dir):
    torch.set_num_threads(1)
    s = RealModelFront(tiny_llama_dir, {family: (source, ToolCallOptions(True, family))
                                        for family, source in TEMPLATES.items()}, (EOS,), max_num_seqs=32, num_blocks=512)
    yield s
    s.stop()


def _tool_schema(name: str) -> dict:
    return next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == name)


def _stream(stream) -> tuple[str, dict[int, dict], str | None]:
    content, calls, reason = "", {}, None
    for chunk in stream:
        for c in chunk.choices:
            assert len(chunk.choices) == 1
            content += c.delta.content or ""
            for tc in c.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"name": None, "arguments": "", "id": None})
                call["id"] = call["id"] or tc.id
                call["name"] = call["name"] or (tc.function.name if tc.function else None)
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            reason = c.finish_reason or reason
    return content, calls, reason


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_required_tool_calls_always_parse_and_match_their_tools(served, family):
    client = served.client(family)
    call_id = "abcDEF123"  # 9 alphanumerics: what the Mistral-style template demands
    for messages in ([{"role": "user", "content": "Weather in Paris?"}], history(call_id)):
        r = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=300)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls", choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), _tool_schema(call.function.name))
        content, calls, reason = _stream(client.chat.completions.create(
            model="tiny", messages=messages, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=300,
            stream=True))
        assert reason == "tool_calls" and content == ""
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
            [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]


@pytest.mark.parametrize("family", list(TEMPLATES))
def test_a_named_function_is_called_with_arguments_that_match_it(served, family):
    named = {"type": "function", "function": {"name": "get_time"}}
    client = served.client(family)
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Time?"}], tools=TOOLS,
                                       tool_choice=named, temperature=0.7, seed=3, max_tokens=200)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(call.function.arguments), _tool_schema("get_time"))
    _, calls, _ = _stream(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Time?"}], tools=TOOLS, tool_choice=named, temperature=0.7,
        seed=3, max_tokens=200, stream=True))
    assert json.loads(calls[0]["arguments"]) == json.loads(call.function.arguments)  # the seed draws the same


def test_a_json_schema_response_parses_validates_and_streams_the_same(served):
    client = served.client("hermes")
    fmt = {"type": "json_schema", "json_schema": {"name": "card", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "A card"}],
                                       response_format=fmt, temperature=0, max_tokens=200)
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    content, _, reason = _stream(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "A card"}], response_format=fmt, temperature=0,
        max_tokens=200, stream=True))
    assert content == r.choices[0].message.content and reason == "stop"


def test_n_choices_seeds_and_a_stop_string_under_a_grammar(served):
    client = served.client("hermes")
    r = client.completions.create(model="tiny", prompt="Once upon", n=3, seed=11, temperature=1.0, max_tokens=200,
                                  extra_body={"structured_outputs": {"json": SCHEMA}})
    texts = [c.text for c in r.choices]
    for c in r.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
    again = client.completions.create(model="tiny", prompt="Once upon", n=3, seed=11, temperature=1.0, max_tokens=200,
                                      extra_body={"structured_outputs": {"json": SCHEMA}})
    assert [c.text for c in again.choices] == texts
    cut = client.completions.create(model="tiny", prompt="Once upon", seed=11, temperature=1.0, max_tokens=200,
                                    stop=['"n"'], extra_body={"structured_outputs": {"json": SCHEMA}})
    assert cut.choices[0].finish_reason == "stop" and texts[0].startswith(cut.choices[0].text)
    assert '"n"' not in cut.choices[0].text


def test_the_max_tokens_cut_ends_by_length_with_the_text_as_generated(served):
    client = served.client("hermes")
    full = client.completions.create(model="tiny", prompt="Go", temperature=0, max_tokens=200,
                                     extra_body={"structured_outputs": {"json": SCHEMA}, "return_token_ids": True})
    cut = client.completions.create(model="tiny", prompt="Go", temperature=0, max_tokens=5,
                                    extra_body={"structured_outputs": {"json": SCHEMA}})
    assert cut.choices[0].finish_reason == "length" and full.choices[0].text.startswith(cut.choices[0].text)


def _echo_logprobs(served, prompt: str) -> tuple:
    r = served.client("hermes").completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                                   logprobs=2, echo=True)
    return r.choices[0].logprobs, r.choices[0].text


def test_echo_with_logprobs_scores_the_prompt_on_the_executor(served, tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    prompt = "The quick brown fox jumps over the lazy dog"
    lp, text = _echo_logprobs(served, prompt)
    ids = tok.encode(prompt).ids
    assert text.startswith(prompt) and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    hf = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0], -1)
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([float(ref[i, ids[i + 1]]) for i in range(len(ids) - 1)],
                                                          abs=1e-3)
    assert all(len(top) <= 3 for top in lp.top_logprobs[1:])  # 2 alternatives and the token itself


def test_echo_with_logprobs_of_a_long_prompt(served):
    """A long prompt's scores are within the result bound its plans allow (InFlight.scoring)."""
    lp, _ = _echo_logprobs(served, "word " * 1000)  # about 3,000 tokens, in chunks, at 2 alternatives each
    assert len(lp.token_logprobs) > 3000
    assert all(x is not None for x in lp.token_logprobs[1:3000])
