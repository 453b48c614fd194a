"""End to end over HTTP: the official openai client (and curl) against real scheduler and executor
processes, compared with the gRPC API on the same stack."""

from __future__ import annotations

import http.client
import json
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import grpc
import openai
import pytest

from pagedserve.v1 import generation_pb2 as pb
from testing.stack import Stack

pytestmark = pytest.mark.slow
MESSAGES = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What does PagedAttention store in blocks?"},
    {"role": "assistant", "content": "The KV cache."},
    {"role": "user", "content": "And how big is a block?"},
]
MAX_NUM_SEQS, MAX_QUEUED = 4, 2  # small, so that a full queue (429) is easy to reach
SERVED_NAME = "org/tiny-chat"  # --served-model-name: the API's name, not the model directory's


@pytest.fixture(scope="module")
def stack(tiny_llama_dir, tmp_path_factory):
    with Stack.running(tiny_llama_dir, tmp_path_factory.mktemp("http-e2e"),
                       ["--max-num-seqs", str(MAX_NUM_SEQS), "--max-n", str(MAX_NUM_SEQS), "--max-beam-width",
                        str(MAX_NUM_SEQS), "--max-queued-requests", str(MAX_QUEUED),
                        "--served-model-name", SERVED_NAME]) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.http_url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client) -> str:
    return client.models.list().data[0].id


def _grpc(stack: Stack, **request) -> tuple[dict[int, str], dict[int, list[int]], pb.Usage]:
    text: dict[int, str] = {}
    tokens: dict[int, list[int]] = {}
    usage = None
    for resp in stack.stub.Generate(pb.GenerateRequest(**request), timeout=120):
        for c in resp.choices:
            text[c.index] = text.get(c.index, "") + c.text
            tokens.setdefault(c.index, []).extend(c.token_ids)
        if resp.HasField("usage"):
            usage = resp.usage
    return text, tokens, usage


def _greedy(max_tokens: int, **kw) -> pb.SamplingParams:
    return pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)



def test_models_and_health_describe_the_served_model(stack, client, model):
    info = stack.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    (card,) = client.models.list().data
    assert card.id == info.model_name == model == SERVED_NAME and card.max_model_len == info.max_model_len
    with urllib.request.urlopen(stack.http_url + "/health", timeout=5) as health:
        assert health.status == 200 and json.loads(health.read()) == {"status": "ok"}


def test_requests_name_the_served_model_and_responses_carry_it(stack, client, tiny_llama_dir):
    r = client.completions.create(model=SERVED_NAME, prompt="a", max_tokens=2)
    assert r.model == SERVED_NAME and r.usage.completion_tokens == 2
    with pytest.raises(openai.NotFoundError):  # (the directory's name is not an alias)
        client.completions.create(model=tiny_llama_dir.name, prompt="a", max_tokens=2)
    with pytest.raises(grpc.RpcError) as e:
        next(iter(stack.stub.Generate(pb.GenerateRequest(prompt="a", model=tiny_llama_dir.name,
                                                         sampling=_greedy(2)), timeout=30)))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("prompt", ["The quick brown fox jumps over", [5, 17, 99, 3, 250, 31, 7]],
                         ids=["text", "token-ids"])
def test_greedy_completion_equals_grpc(stack, client, model, prompt, stream):
    grpc_prompt = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
    want, want_ids, usage = _grpc(stack, **grpc_prompt, sampling=_greedy(24))
    r = client.completions.create(model=model, prompt=prompt, max_tokens=24, temperature=0, stream=stream,
                                  extra_body={"ignore_eos": True, "return_token_ids": True},
                                  **({"stream_options": {"include_usage": True}} if stream else {}))
    if stream:
        chunks = list(r)
        text = "".join(c.choices[0].text for c in chunks if c.choices)
        ids = [t for c in chunks if c.choices for t in c.choices[0].token_ids]
        finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
        got_usage = chunks[-1].usage
    else:
        text, ids, finish, got_usage = r.choices[0].text, r.choices[0].token_ids, [r.choices[0].finish_reason], r.usage
    assert text == want[0] and ids == want_ids[0] and len(ids) == 24
    assert finish == ["length"]
    assert (got_usage.prompt_tokens, got_usage.completion_tokens) == (usage.prompt_tokens, 24)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_greedy_chat_equals_grpc_on_the_prompt_transformers_renders(stack, client, model, tiny_llama_dir, stream):
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(tiny_llama_dir).apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False)
    want, _, usage = _grpc(stack, prompt_token_ids=ids, sampling=_greedy(16))
    r = client.chat.completions.create(model=model, messages=MESSAGES, max_completion_tokens=16, temperature=0,
                                       stream=stream, extra_body={"ignore_eos": True})
    if stream:
        chunks = list(r)
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
    else:
        text = r.choices[0].message.content
        assert r.usage.prompt_tokens == len(ids) == usage.prompt_tokens
    assert text == want[0] and text


def test_n2_with_a_seed_is_reproducible_and_choice_i_samples_with_seed_plus_i(client, model):
    def run(n: int, seed: int) -> list[str]:
        r = client.completions.create(model=model, prompt="Once upon a time", n=n, seed=seed, temperature=1.0,
                                      max_tokens=12, extra_body={"ignore_eos": True})
        assert [c.index for c in r.choices] == list(range(n)) and r.usage.completion_tokens == 12 * n
        return [c.text for c in r.choices]

    first = run(2, 1234)
    assert run(2, 1234) == first and first[0] != first[1]
    assert run(1, 1235) == [first[1]]
    # The first send prefills the whole prompt, the next ones hit the prefix cache and prefill only
    # its tail: the same tokens and the same logprobs to the last bit (issue #43).
    chat = [client.chat.completions.create(model=model, messages=MESSAGES[1:2], seed=99, max_tokens=8,
                                           logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True}).choices[0]
            for _ in range(3)]
    assert chat[0].message.content == chat[1].message.content == chat[2].message.content
    lps = [[(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in c.logprobs.content]
           for c in chat]
    assert lps[0] == lps[1] == lps[2]


def test_stop_string_cuts_the_text_before_it(client, model):
    prompt = "Continuous batching lets requests join and leave"
    full = client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    stop = full[8:12]
    r = client.completions.create(model=model, prompt=prompt, max_tokens=32, temperature=0, stop=[stop],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:full.index(stop)] and r.choices[0].finish_reason == "stop"


def test_logprobs_in_both_forms_equal_grpc(stack, client, model):
    prompt = [5, 17, 99, 3, 250, 31, 7]
    lps = [lp for resp in stack.stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt,
                                                                 sampling=_greedy(6, logprobs=2)), timeout=60)
           for c in resp.choices for lp in c.logprobs]
    r = client.completions.create(model=model, prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                                  extra_body={"ignore_eos": True})
    got = r.choices[0].logprobs
    assert got.token_logprobs == pytest.approx([lp.logprob for lp in lps], abs=1e-5)
    for top, want in zip(got.top_logprobs, lps, strict=True):  # {text: logprob}: ids with one text collide
        assert 1 <= len(top) <= 2
        assert all(any(v == pytest.approx(w.logprob, abs=1e-5) for w in want.top_logprobs) for v in top.values())
    c = client.chat.completions.create(model=model, messages=MESSAGES[1:2], max_tokens=5, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 5 and all(len(e.top_logprobs) == 3 for e in content)
    assert "".join(e.token for e in content) == c.choices[0].message.content


def test_beam_search_and_a_batch_of_prompts(stack, client, model):
    prompt = [5, 17, 99, 3, 250, 31, 7]
    want, _, _ = _grpc(stack, prompt_token_ids=prompt,
                       sampling=pb.SamplingParams(max_tokens=8, beam_width=2, ignore_eos=True))
    r = client.completions.create(model=model, prompt=prompt, n=2, max_tokens=8,
                                  extra_body={"use_beam_search": True, "ignore_eos": True})
    assert [c.text for c in r.choices] == [want[0], want[1]]  # best beam first, as gRPC
    prompts = ["Hello there", "Goodbye now"]
    batch = client.completions.create(model=model, prompt=prompts, max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True})
    for i, p in enumerate(prompts):
        assert batch.choices[i].text == _grpc(stack, prompt=p, sampling=_greedy(6))[0][0]


def test_prefix_cache_hits_show_in_usage(client, model):
    prompt = "The quick brown fox jumps over the lazy dog. " * 6
    for _ in range(2):
        chunks = list(client.completions.create(model=model, prompt=prompt, max_tokens=4, stream=True,
                                                stream_options={"include_usage": True}))
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage.prompt_tokens_details.cached_tokens >= 16
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_cancelled_stream_frees_its_blocks_at_once(stack, client, model, endpoint):
    kw = dict(model=model, max_tokens=3000, stream=True, extra_body={"ignore_eos": True})
    stream = (client.completions.create(prompt="Tell me everything. " * 10, **kw) if endpoint == "completions"
              else client.chat.completions.create(messages=MESSAGES, **kw))
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert sum(e.kv_blocks_used for e in stack.stats().executors) > 0  # it holds blocks while it runs
    stream.close()
    assert stack.wait_blocks_free(timeout_s=5) < 2.0  # 3000 tokens would take far longer


def test_a_client_timeout_on_a_whole_response_frees_its_blocks(stack, client, model):
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=1.0).completions.create(model=model, prompt="x", max_tokens=3000,
                                                            extra_body={"ignore_eos": True})
    assert stack.wait_blocks_free(timeout_s=5) < 2.0


@pytest.mark.parametrize("kw,status,param", [
    ({"temperature": -1}, 400, "temperature"),
    ({"max_tokens": 10**6}, 400, "max_tokens"),
    ({"n": 99}, 400, "n"),
    ({"stop": [""]}, 400, "stop"),
    ({"logprobs": 999}, 400, "logprobs"),
    ({"extra_body": {"top_k": -5}}, 400, "top_k"),
    ({"prompt": [[1, 2], [10**7]]}, 400, "prompt"),
    ({"model": "no-such-model"}, 404, "model"),
])
def test_bad_input_gets_its_status_and_the_server_keeps_serving(client, model, kw, status, param):
    args = dict(model=model, prompt="hello", max_tokens=2) | kw
    with pytest.raises(openai.APIStatusError) as err:
        client.completions.create(**args)
    assert err.value.status_code == status and err.value.body["param"] == param
    assert client.completions.create(model=model, prompt="hello", max_tokens=2).usage.completion_tokens >= 1


def test_malformed_and_oversized_bodies_over_raw_http(stack):
    conn = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=10)
    conn.request("POST", "/v1/chat/completions", body=b'{"messag', headers={"Content-Type": "application/json"})
    reply = conn.getresponse()
    assert reply.status == 400 and json.loads(reply.read())["error"]["code"] == "invalid_json"
    conn.close()
    with socket.create_connection(("127.0.0.1", stack.http_port), timeout=10) as s:  # 100 GB announced
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000000000\r\n\r\n{")
        assert s.recv(65536).startswith(b"HTTP/1.1 413")


def test_queue_full_is_429(stack, client, model):
    """max_num_seqs requests run, max_queued_requests wait: the next one is refused with 429."""
    streams = [client.completions.create(model=model, prompt=f"Runner {i}", max_tokens=3000, stream=True,
                                         extra_body={"ignore_eos": True}) for i in range(MAX_NUM_SEQS)]
    waiting = [threading.Thread(target=client.completions.create,
                                kwargs=dict(model=model, prompt=f"Waiter {i}", max_tokens=2))
               for i in range(MAX_QUEUED)]
    try:
        for t in waiting:
            t.start()
        deadline = time.monotonic() + 20
        while stack.stats().num_waiting < MAX_QUEUED:
            assert time.monotonic() < deadline, stack.stats()
            time.sleep(0.05)
        with pytest.raises(openai.RateLimitError) as err:
            client.completions.create(model=model, prompt="one too many", max_tokens=2)
        assert err.value.status_code == 429 and err.value.body["code"] == "queue_full"
    finally:
        for s in streams:
            s.close()
        for t in waiting:
            t.join(60)
    stack.wait_blocks_free()


def test_curl_sees_server_sent_events_ending_with_done(stack, model):
    body = {"model": model, "messages": MESSAGES[1:2], "max_tokens": 5, "stream": True,
            "extra": "ignored", "ignore_eos": True}
    out = subprocess.run(["curl", "-sN", "-D", "-", f"{stack.http_url}/v1/chat/completions",
                          "-H", "Content-Type: application/json", "-d", json.dumps(body)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    head, _, events = out.partition("\n\n")  # text mode: curl's \r\n read as \n
    assert head.startswith("HTTP/1.1 200") and "content-type: text/event-stream" in head.lower()
    blocks = events.split("\n\n")
    assert blocks[-2:] == ["data: [DONE]", ""]
    chunks = [json.loads(b.removeprefix("data: ")) for b in blocks[:-2]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_503_until_an_executor_joins(tiny_llama_dir, tmp_path):
    s = Stack(tiny_llama_dir, tmp_path)
    try:
        s.start_scheduler()
        c = openai.OpenAI(base_url=s.http_url + "/v1", api_key="unused", max_retries=0, timeout=10)
        with pytest.raises(openai.InternalServerError) as err:
            c.completions.create(model="any", prompt="hi", max_tokens=2)
        assert err.value.status_code == 503 and err.value.body["code"] == "no_executor"
        with pytest.raises(grpc.RpcError):  # and gRPC agrees
            s.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=5)
    finally:
        s.stop()


def test_the_bench_drives_both_fronts_with_the_same_requests(stack, tmp_path):
    from pagedserve.bench.loadgen import main

    out = tmp_path / "bench.json"
    rc = main(["--server", f"127.0.0.1:{stack.port}", "--http-server", stack.http_url, "--api", "grpc,http",
               "--workload", "fixed", "--input-len", "8:40", "--output-len", "4:12", "--num-requests", "6",
               "--max-concurrency", "2", "--no-progress", "--out", str(out)])
    assert rc == 0
    runs = json.loads(out.read_text())["runs"]
    grpc_run, http_run = runs["grpc"][0], runs["http"][0]
    assert http_run["completed"] == grpc_run["completed"] == 6 and http_run["short_outputs"] == 0
    assert http_run["total_output_tokens"] == grpc_run["total_output_tokens"]  # exact counts over SSE too
    assert 0 < http_run["ttft_ms"]["p50"] <= http_run["e2e_latency_ms"]["p50"]


def test_sigterm_refuses_new_http_requests_and_cuts_streams_after_the_grace(tiny_llama_dir, tmp_path):
    with Stack.running(tiny_llama_dir, tmp_path, ["--shutdown-grace-seconds", "1"]) as s:
        c = openai.OpenAI(base_url=s.http_url + "/v1", api_key="unused", max_retries=0, timeout=60)
        stream = c.completions.create(model=c.models.list().data[0].id, prompt="x", max_tokens=3000, stream=True,
                                      extra_body={"ignore_eos": True})
        chunks = iter(stream)
        next(chunks)
        s.scheduler.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(openai.InternalServerError) as err:  # new requests: 503 at once
            c.completions.create(model="any", prompt="late", max_tokens=2)
        assert err.value.status_code == 503 and err.value.body["code"] == "shutting_down"
        # The running stream is cut at the grace period, and told so: finish_reason takes only OpenAI's
        # values, so the cut is an error event in the stream (503 shutting_down), not a finish.
        with pytest.raises(openai.APIError) as cut:
            for ch in chunks:
                assert not (ch.choices and ch.choices[0].finish_reason)
        assert cut.value.body["code"] == "shutting_down"
        assert s.scheduler.wait(timeout=20) == 0
