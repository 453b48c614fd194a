"""Structured outputs across real processes: the grammar state follows a request that migrates
after its executor is killed with kill -9, and the public ports serve what the issue's clients use."""

from __future__ import annotations

import json
import re
import signal
import socket
import time

import grpc
import jsonschema
import pytest
from tokenizers import Tokenizer

from pagedserve.v1 import generation_pb2 as pb
from testing.stack import Stack

pytestmark = pytest.mark.slow
SCHEMA = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                                     "minItems": 6, "maxItems": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 999}},
          "required": ["words", "n"], "additionalProperties": False}
REGEX = "[a-z]{8}( [a-z]{8}){6,9}"


def _request(i: int) -> pb.GenerateRequest:
    so = pb.StructuredOutputs(json_schema=json.dumps(SCHEMA)) if i % 2 else pb.StructuredOutputs(regex=REGEX)
    return pb.GenerateRequest(prompt_token_ids=[(i * 13 + j * 7) % 480 + 3 for j in range(10 + i)],
                              sampling=pb.SamplingParams(max_tokens=150, temperature=0.0, structured_outputs=so))


def _run(stack: Stack, n: int, on_progress=None) -> list[list[int] | grpc.RpcError]:
    return stack.stream_all([_request(i) for i in range(n)], on_progress)


def _kill_a_busy_executor(stack: Stack, killed: list[str]):
    def hook(progress: list[int]) -> None:
        deadline = time.monotonic() + 60
        while sum(p > 4 for p in progress) < 4:
            assert time.monotonic() < deadline, "streams did not start"
            time.sleep(0.02)
        busy = [e.id for e in stack.stats().executors if e.state == "ready" and e.num_running > 0]
        stack.executors[busy[0]].send_signal(signal.SIGKILL)
        killed.append(busy[0])
    return hook


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tmp_path_factory):
    with Stack.running(tiny_llama_dir, tmp_path_factory.mktemp("structured"), executors=("ex0", "ex1")) as s:
        s.wait_executors(2)
        yield s


def test_an_invalid_spec_is_invalid_argument_and_head_metrics_is_bodiless_on_the_api_port(stack):
    with pytest.raises(grpc.RpcError) as e:
        list(stack.stub.Generate(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(
            structured_outputs=pb.StructuredOutputs(regex="(unclosed"))), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "sampling.structured_outputs.regex" in e.value.details()
    with socket.create_connection(("127.0.0.1", stack.http_port), timeout=10) as sock:
        sock.sendall(b"HEAD /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == b"", data[:200]


def test_the_grammar_state_follows_a_request_that_migrates_after_kill_9(stack, tiny_llama_dir):
    reference = _run(stack, 8)
    tok = Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))
    for i, toks in enumerate(reference):
        text = tok.decode(toks[:-1] if toks[-1] == 0 else toks)
        if i % 2:
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert re.fullmatch(REGEX, text), text
    killed: list[str] = []
    again = _run(stack, 8, on_progress=_kill_a_busy_executor(stack, killed))
    assert killed and stack.stats().num_migrations > 0
    assert again == reference  # rebuilt from the tokens on the other executor, token for token
