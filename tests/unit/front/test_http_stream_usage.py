"""``stream_options.continuous_usage_stats`` with n > 1: each chunk's usage counts its own choice's
tokens and its own prompt's, as vLLM's completions and chat streams do
(``completion_tokens = previous_num_tokens[i]``); the final usage chunk is the whole request's."""

from __future__ import annotations

import json

import pytest

from scheduler_svc.front.http.chat_template import ChatTemplate
from scheduler_svc.front.http.limits import HttpLimits
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.telemetry.metrics import Metrics
from testing.grpc_fakes import FakeEngine, make_tokenizer
from testing.http_fakes import CHATML, HttpThread

USAGE = {"include_usage": True, "continuous_usage_stats": True}


@pytest.fixture(scope="module")
def server():
    srv = HttpThread(FakeEngine(make_tokenizer(), 256), ChatTemplate.compile(CHATML), ServerLimits(max_n=4),
                     HttpLimits(max_prompts=2), Metrics())
    yield srv
    srv.stop()


@pytest.fixture()
def fake(server):
    srv = server.fresh()
    srv.engine.completions = ["Hello world, the end.", "Good day"]  # choices of different lengths
    return srv


def _events(fake, path: str, body: dict) -> list[dict]:
    # return_token_ids: every token comes in a chunk (none held back), so the test can count them.
    status, raw = fake.request("POST", path, {"max_tokens": 20, "n": 2, "stream": True, "stream_options": USAGE,
                                              "return_token_ids": True, **body})
    assert status == 200, raw
    lines = [ln[6:] for ln in raw.decode().split("\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def _check_per_choice(events: list[dict], prompt_tokens: list[int], n: int) -> None:
    """Each chunk's usage: its choice's tokens so far and its prompt's; the last chunk: the totals."""
    *chunks, last = events
    seen: dict[int, int] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        index = choice["index"]
        seen[index] = seen.get(index, 0) + len(choice["token_ids"])
        prompt = prompt_tokens[index // n]
        assert chunk["usage"] == {"prompt_tokens": prompt, "completion_tokens": seen[index],
                                  "total_tokens": prompt + seen[index]}, chunk
    assert len(set(seen.values())) > 1  # the choices' counts differ: a running total could not pass
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == sum(seen.values())
    assert last["usage"]["prompt_tokens"] == sum(prompt_tokens)


def test_completions_chunks_count_their_own_choice_and_prompt(fake):
    events = _events(fake, "/v1/completions", {"prompt": ["Hi", "Hello there"]})
    _check_per_choice(events, [len(g.prompt_token_ids) for g in fake.engine.requests], 2)


def test_chat_chunks_count_their_own_choice(fake):
    events = _events(fake, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})
    _check_per_choice(events, [len(fake.engine.requests[0].prompt_token_ids)], 2)
