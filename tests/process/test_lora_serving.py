"""LoRA adapters through the real services: a scheduler with --lora-modules and a CPU executor with
two adapter slots serve three PEFT adapters and the base model at once, each request's greedy
tokens equal to transformers with that adapter merged (PEFT's merge_and_unload), token for token.

Also: /v1/models lists the adapters with their base as parent, the OpenAI `model` field selects
one, an unknown name is 404 / NOT_FOUND, a shared prompt hits the prefix cache under its own
adapter only, and no block is leaked at the end."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import grpc
import pytest
import torch

from pagedserve.v1 import generation_pb2 as pb
from testing.executor_plans import hf_greedy
from testing.lora_adapters import greedy_tokens, make_adapter, served_greedy
from testing.stack import Stack

pytestmark = pytest.mark.slow

ADAPTERS = {  # name -> (targets, r, alpha, rsLoRA)
    "sql": (["q_proj", "v_proj"], 8, 16, False),
    "chat": (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], 4, 8, True),
    "poet": (["o_proj", "down_proj"], 16, 32, False),
}
PROMPTS = [[5, 17, 99, 3, 250, 31, 7, 41, 8, 12, 300, 2, 77, 19, 45, 6, 90], [40, 41, 42, 43, 44, 45, 46]]
MAX_NEW = 10


@pytest.fixture(scope="module")
def served(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("lora-serving")
    refs = {}
    for i, (name, (targets, r, alpha, rs)) in enumerate(ADAPTERS.items()):
        merged = make_adapter(tiny_llama_dir, root / name, targets, r, alpha, rs, seed=10 + i)
        refs[name] = [hf_greedy(merged, p, MAX_NEW) for p in PROMPTS]
    base = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    refs[None] = [hf_greedy(base, p, MAX_NEW) for p in PROMPTS]
    merged = make_adapter(tiny_llama_dir, root / "late", ["v_proj", "up_proj"], 8, 16, False, seed=20)
    refs["late"] = [hf_greedy(merged, p, MAX_NEW) for p in PROMPTS]  # (loaded at run time, not at start)
    modules = [f"{n}={root / n}" for n in ADAPTERS]
    s = Stack(tiny_llama_dir, root, ["--enable-lora", "--max-loras", "2", "--lora-modules", *modules,
                                     "--allow-runtime-lora-updating"], secure=False)
    try:
        s.start_scheduler()
        s.start_executor("ex0", "--enable-lora", "--max-loras", "2", "--lora-dtype", "float32")  # (exact: PEFT in float32)
        s.wait_health()
        yield s, refs
    finally:
        s.stop()


def test_adapters_and_the_base_model_served_together_each_equal_to_peft_merged(served):
    stack, refs = served
    got = served_greedy(stack, PROMPTS, [None, *ADAPTERS], MAX_NEW)
    for (name, i), tokens in got.items():
        assert tokens == refs[name][i], (name, i)
    assert len({tuple(refs[n][0]) for n in refs}) == len(refs)  # every adapter changes the output
    info = stack.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10)
    assert sorted(info.lora_adapters) == sorted(ADAPTERS)


def test_the_prefix_cache_hits_under_the_same_adapter_only(served):
    stack, refs = served
    prompt = list(range(100, 140))  # (two and a half blocks of 16)

    def cached(model):
        req = pb.GenerateRequest(prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=2, temperature=0.0))
        if model:
            req.model = model
        return [r.usage.cached_prompt_tokens for r in stack.stub.Generate(req, timeout=60) if r.HasField("usage")][-1]

    assert cached("sql") == 0
    assert cached("poet") == 0 and cached(None) == 0  # the same tokens under another adapter: other K/V
    assert cached("sql") == 32


def test_openai_model_field_and_models_list(served):
    stack, refs = served
    base = f"http://127.0.0.1:{stack.http_port}/v1"
    with urllib.request.urlopen(f"{base}/models", timeout=30) as r:
        cards = {c["id"]: c for c in json.load(r)["data"]}
    model_name = next(c["id"] for c in cards.values() if c["parent"] is None)
    assert {n: cards[n]["parent"] for n in ADAPTERS} == dict.fromkeys(ADAPTERS, model_name)
    body = {"model": "chat", "prompt": PROMPTS[1], "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    req = urllib.request.Request(f"{base}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        out = json.load(r)
    assert out["model"] == "chat"
    assert out["choices"][0]["token_ids"] == refs["chat"][1]
    body["model"] = "nope"
    req = urllib.request.Request(f"{base}/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 404 and json.load(e.value)["error"]["code"] == "model_not_found"
    with pytest.raises(grpc.RpcError) as g:
        greedy_tokens(stack, PROMPTS[0], "nope", MAX_NEW)
    assert g.value.code() == grpc.StatusCode.NOT_FOUND and "'nope'" in g.value.details()


def test_metrics_name_the_adapters_of_running_requests(served):
    """vllm:lora_requests_info, as the inference gateway's endpoint picker reads it."""
    stack, _ = served
    req = pb.GenerateRequest(prompt_token_ids=PROMPTS[0], model="poet",
                             sampling=pb.SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True))
    call = stack.stub.Generate(req, timeout=120)
    next(call)  # (running now: its first token came)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/metrics", timeout=30) as r:
            text = r.read().decode()
    finally:
        call.cancel()
    line = next(x for x in text.splitlines() if x.startswith("vllm:lora_requests_info{"))
    assert 'max_lora="2"' in line and 'running_lora_adapters="poet"' in line, line


def test_the_deployments_metrics_are_also_under_vllms_names(served):
    """What a dashboard written for vLLM reads: the same values under vllm: names, with the
    served model's name as model_name, in one scrape of the whole deployment."""
    from prometheus_client.parser import text_string_to_metric_families

    stack, _ = served
    greedy_tokens(stack, PROMPTS[0], None, 4)

    def scrape() -> dict:
        with urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/metrics", timeout=30) as r:
            return {(s.name, tuple(sorted(s.labels.items()))): s.value
                    for fam in text_string_to_metric_families(r.read().decode()) for s in fam.samples}

    deadline = time.monotonic() + 20  # (a front sends its counts to the core every second)
    while (samples := scrape()).get(("pagedserve:e2e_request_latency_seconds_count", ()), 0) == 0:
        assert time.monotonic() < deadline, "no request counted"
        time.sleep(0.2)
    for ours, theirs in (("pagedserve:prompt_tokens_total", "vllm:prompt_tokens_total"),
                         ("pagedserve:generation_tokens_total", "vllm:generation_tokens_total"),
                         ("pagedserve:prefix_cache_queries_total", "vllm:prefix_cache_queries_total"),
                         ("pagedserve:e2e_request_latency_seconds_count", "vllm:e2e_request_latency_seconds_count")):
        value = samples[(ours, ())]
        (model_label, copy), = [(labels, v) for (name, labels), v in samples.items() if name == theirs]
        assert value > 0 and copy == value and dict(model_label)["model_name"], (ours, value, copy, model_label)


def _post(stack: Stack, path: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(f"http://127.0.0.1:{stack.http_port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _models(stack: Stack) -> set[str]:
    with urllib.request.urlopen(f"http://127.0.0.1:{stack.http_port}/v1/models", timeout=30) as r:
        return {c["id"] for c in json.load(r)["data"]}


def test_adapters_load_and_unload_at_run_time_and_a_reloaded_name_is_another_adapter(served):
    stack, refs = served
    late = stack.logdir / "late"
    assert _post(stack, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(late)}) == \
        (200, "Success: LoRA adapter 'late' added successfully.")
    assert "late" in _models(stack)  # (at once: the core told every front before it answered)
    assert [greedy_tokens(stack, p, "late", MAX_NEW) for p in PROMPTS] == refs["late"]
    code, body = _post(stack, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(late)})
    assert code == 400 and "already loaded" in body
    code, body = _post(stack, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(late / "nope")})
    assert code == 400 and "no such directory" in body and json.loads(body)["error"]["code"] == "invalid_lora_adapter"
    assert _post(stack, "/v1/unload_lora_adapter", {"lora_name": "late"})[0] == 200
    assert "late" not in _models(stack)
    with pytest.raises(grpc.RpcError) as g:
        greedy_tokens(stack, PROMPTS[0], "late", MAX_NEW)
    assert g.value.code() == grpc.StatusCode.NOT_FOUND
    code, body = _post(stack, "/v1/unload_lora_adapter", {"lora_name": "late"})
    assert code == 404 and json.loads(body)["error"]["code"] == "lora_not_found"
    # The name again, other files: the executor's slot and the cached prompt of the old "late" serve
    # nothing of the new one.
    assert _post(stack, "/v1/load_lora_adapter", {"lora_name": "late", "lora_path": str(stack.logdir / "sql")})[0] == 200
    assert [greedy_tokens(stack, p, "late", MAX_NEW) for p in PROMPTS] == refs["sql"]
    code, body = _post(stack, "/v1/load_lora_adapter", {"lora_name": "y", "lora_path": str(late), "extra": 1})
    assert code == 400
