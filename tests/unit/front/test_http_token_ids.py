"""Token ids on the HTTP front. vLLM's ``return_token_ids``: the prompt's token ids as well as each
choice's, in vLLM's places (completions: each choice's ``prompt_token_ids``; chat: the response's),
whole responses and streams alike; without the flag, neither key appears. ``/detokenize`` inverts
``/tokenize``, special tokens included, as vLLM's does."""

from __future__ import annotations

import json

import pytest

from scheduler_svc.front.http.chat_template import ChatTemplate
from scheduler_svc.front.http.limits import HttpLimits
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.telemetry.metrics import Metrics
from testing.grpc_fakes import FakeEngine, make_tokenizer
from testing.http_fakes import CHATML, HttpThread

MODEL = "tiny-test"
CHAT = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server():
    srv = HttpThread(FakeEngine(make_tokenizer(), 256), ChatTemplate.compile(CHATML), ServerLimits(max_n=4),
                     HttpLimits(max_prompts=2), Metrics())
    yield srv
    srv.stop()


@pytest.fixture()
def fake(server):
    return server.fresh()


def _post(fake, path: str, body: dict) -> dict:
    status, raw = fake.request("POST", path, {"model": MODEL, "max_tokens": 4, **body})
    assert status == 200, raw
    return json.loads(raw)


def _events(fake, path: str, body: dict) -> list[dict]:
    status, raw = fake.request("POST", path, {"model": MODEL, "max_tokens": 4, "stream": True, **body})
    assert status == 200, raw
    lines = [ln[6:] for ln in raw.decode().split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_completions_choices_carry_their_prompts_token_ids(fake):
    r = _post(fake, "/v1/completions", {"prompt": ["Hi", "Hello there"], "n": 2, "return_token_ids": True})
    ids = [g.prompt_token_ids for g in fake.engine.requests]
    assert [c["prompt_token_ids"] for c in r["choices"]] == [ids[0], ids[0], ids[1], ids[1]]
    assert all(c["token_ids"] for c in r["choices"])
    r = _post(fake, "/v1/completions", {"prompt": [5, 6, 7], "return_token_ids": True})
    assert r["choices"][0]["prompt_token_ids"] == [5, 6, 7]


def test_completions_stream_sends_the_prompts_ids_in_each_choices_first_chunk(fake):
    events = _events(fake, "/v1/completions", {"prompt": "Hi", "n": 2, "return_token_ids": True})
    ids = fake.engine.requests[-1].prompt_token_ids
    for index in (0, 1):
        mine = [c for e in events for c in e["choices"] if c["index"] == index]
        assert mine[0]["prompt_token_ids"] == ids
        assert all("prompt_token_ids" not in c for c in mine[1:])


def test_chat_response_carries_the_rendered_prompts_token_ids(fake):
    r = _post(fake, "/v1/chat/completions", {"messages": CHAT, "return_token_ids": True})
    assert r["prompt_token_ids"] == fake.engine.requests[-1].prompt_token_ids
    assert r["prompt_token_ids"] and r["choices"][0]["token_ids"]


def test_chat_stream_sends_the_prompts_ids_once_per_choice_in_its_first_chunk(fake):
    events = _events(fake, "/v1/chat/completions", {"messages": CHAT, "n": 2, "return_token_ids": True})
    ids = fake.engine.requests[-1].prompt_token_ids
    firsts = [e for e in events if e["choices"] and "role" in e["choices"][0]["delta"]]
    assert sorted(e["choices"][0]["index"] for e in firsts) == [0, 1]
    assert all(e["prompt_token_ids"] == ids for e in firsts)
    assert sum("prompt_token_ids" in e for e in events) == 2


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Hi"}),
                                       ("/v1/chat/completions", {"messages": CHAT})])
def test_without_the_flag_no_token_ids_at_all(fake, path, body):
    text = json.dumps(_post(fake, path, body)) + json.dumps(_events(fake, path, body))
    assert "token_ids" not in text



def test_detokenize_inverts_tokenize_special_tokens_included(fake):
    """Special tokens dropped, /detokenize gave text that tokenizes to other ids: a prompt's BOS, and a
    chat prompt's template markers where the model's tokenizer has them as special tokens."""
    ids = _post(fake, "/tokenize", {"prompt": "Hello world"})["tokens"]
    text = _post(fake, "/detokenize", {"tokens": ids})["prompt"]
    assert text == "<s>Hello world"  # (the fake tokenizer's BOS, which /tokenize added)
    assert _post(fake, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"] == ids
