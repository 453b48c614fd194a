"""The runtime LoRA endpoints (front/http/lora_routes.py) over the fake engine: what the front
refuses itself, before asking the engine cores."""

from __future__ import annotations

import json

import pytest

from pagedserve.wire.front_messages import Answer
from testing.grpc_fakes import FakeEngine, make_tokenizer
from testing.http_fakes import HttpThread


@pytest.fixture()
def http():
    engine = FakeEngine(make_tokenizer())
    engine.lora_calls = []

    async def update_lora(name: str, path: str | None) -> Answer:
        engine.lora_calls.append((name, path))
        return Answer(0)

    engine.update_lora = update_lora
    srv = HttpThread(engine, lora_updates=True)
    yield srv
    srv.stop()


def test_an_adapter_may_not_take_the_served_models_name(http):
    assert http.engine.info.model_name == "tiny-test"
    status, body = http.request("POST", "/v1/load_lora_adapter", {"lora_name": "tiny-test", "lora_path": "/a"})
    assert status == 400
    assert json.loads(body)["error"] == {
        "message": "lora_name: LoRA adapter name 'tiny-test' is the served model's name (requests naming it get "
                   "the base model); choose another",
        "type": "invalid_request_error", "param": "lora_name", "code": "invalid_lora_adapter"}
    assert http.engine.lora_calls == []  # no engine core was asked


def test_any_other_name_is_passed_to_the_engine(http):
    status, body = http.request("POST", "/v1/load_lora_adapter", {"lora_name": "tiny-test2", "lora_path": "/a"})
    assert (status, body) == (200, b"Success: LoRA adapter 'tiny-test2' added successfully.")
    assert http.engine.lora_calls == [("tiny-test2", "/a")]
