"""Structured outputs on the executor: the grammar masks every sampled token, checked against
transformers' generate with xgrammar's own logits processor, over random JSON schemas, and
through everything a sequence can live through (n > 1, seeds, chunked prefill, prefix hits,
preemption by recompute and swap, the prepared-ahead pipeline, tensor parallelism)."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
import xgrammar as xgr
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from executor_svc.grammar import (
    _BOUNDED_STRING_CHARS,
    NO_TOKEN_ALLOWED,
    GrammarBackend,
    GrammarError,
    choice_grammar,
    json_schema_grammar,
)
from executor_svc.model import load_model
from pagedserve.engine_api import ErrorKind, FinishReason, GenerationRequest, RequestParams
from pagedserve.wire import (
    STRUCTURED_CHOICE,
    STRUCTURED_GRAMMAR,
    STRUCTURED_JSON,
    STRUCTURED_REGEX,
    SamplingParams,
    Structured,
)
from scheduler_svc.sched.scheduler import Scheduler
from scheduler_svc.sched.scheduler_config import SchedulerConfig
from testing.executor_plans import drive, make_runner, serve_requests
from testing.json_schemas import random_schema
from testing.tp_harness import tp_runner
from tests.unit.executor.test_step_pipeline import serve_pipelined

EOS = 0  # the tiny models' <|endoftext|>
SCHEMA = {  # $ref, enum, anyOf, numbers with bounds, arrays with minItems, an optional property
    "$defs": {"point": {"type": "object", "properties": {"x": {"type": "integer", "minimum": -9, "maximum": 9},
                                                          "y": {"type": "number", "minimum": 0, "maximum": 1}},
                        "required": ["x", "y"], "additionalProperties": False}},
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "color": {"enum": ["red", "green", 3]},
                   "at": {"$ref": "#/$defs/point"}, "tags": {"type": "array", "items": {"type": "boolean"},
                                                               "minItems": 2, "maxItems": 3},
                   "id": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 99}, {"type": "null"}]},
                   "note": {"type": "string", "maxLength": 3}},
    "required": ["name", "color", "at", "tags", "id"], "additionalProperties": False,
}
SPECS = {
    "json": Structured(STRUCTURED_JSON, json.dumps(SCHEMA)),
    "regex": Structured(STRUCTURED_REGEX, r"(cat|dog)s? [0-9]{2,4}(\.[0-9])?"),
    "choice": Structured(STRUCTURED_CHOICE, json.dumps(["yes", "no", "maybe \"so\""])),
    "grammar": Structured(STRUCTURED_GRAMMAR, 'root ::= "(" item ("," item){0,3} ")"\nitem ::= [a-c] | "x" [0-9]'),
}
PROMPTS = [[5, 17, 99, 23, 7, 200, 31], [44, 2, 301, 9], list(range(60, 100))]


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(tiny_llama_dir)


@pytest.fixture(scope="module")
def backend(tiny_llama_dir, model):
    return GrammarBackend.for_model(tiny_llama_dir, model.cfg.vocab_size)


@pytest.fixture(scope="module")
def hf(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir) -> Tokenizer:
    return Tokenizer.from_file(str(tiny_llama_dir / "tokenizer.json"))


def _sampling(spec: Structured, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0.0, **kw}, structured=spec, end_token_ids=[EOS])


def _serve(runner, reqs: dict[str, GenerationRequest], **cfg) -> tuple[dict[str, list[list[int]]], Scheduler]:
    config = dict(block_size=16, max_model_len=512, max_num_seqs=256, max_num_batched_tokens=4096) | cfg
    blocks = runner.kv.num_blocks
    sched = Scheduler(SchedulerConfig(**config), blocks, runner.kv.num_cpu_blocks, eos_token_ids=(EOS,))
    return serve_requests(runner, sched, reqs), sched


def _reference(hf, tiny_llama_dir, spec: Structured, prompt: list[int], max_new: int) -> list[int]:
    """transformers' greedy generate with xgrammar's own HF logits processor, the grammar compiled
    from the same text the executor compiles."""
    tok = PreTrainedTokenizerFast(tokenizer_file=str(tiny_llama_dir / "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=hf.config.vocab_size, stop_token_ids=[EOS])
    text = {STRUCTURED_JSON: json_schema_grammar, STRUCTURED_CHOICE: lambda s: choice_grammar(json.loads(s))}
    compiler = xgr.GrammarCompiler(info)
    compiled = (compiler.compile_regex(spec.spec) if spec.kind == STRUCTURED_REGEX
                else compiler.compile_grammar(text.get(spec.kind, str)(spec.spec)))
    out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                      max_new_tokens=max_new, do_sample=False, logits_processor=[xgr.contrib.hf.LogitsProcessor(compiled)],
                      pad_token_id=EOS, eos_token_id=EOS)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("kind", list(SPECS))
def test_greedy_constrained_output_equals_transformers_with_xgrammars_logits_processor(
        tiny_llama_dir, model, backend, hf, tokenizer, kind):
    runner = make_runner(tiny_llama_dir, model=model)
    runner.grammar = backend
    reqs = {f"r{i}": GenerationRequest(f"r{i}", p, RequestParams(max_tokens=200, sampling=_sampling(SPECS[kind])))
            for i, p in enumerate(PROMPTS)}
    out, _ = _serve(runner, reqs)
    for i, prompt in enumerate(PROMPTS):
        got = out[f"r{i}"][0]
        assert got == _reference(hf, tiny_llama_dir, SPECS[kind], prompt, 200), (kind, i)
        assert got[-1] == EOS, "the grammar accepted its end: the sequence ends with EOS"
    if kind == "json":
        for i in range(len(PROMPTS)):
            jsonschema.validate(json.loads(tokenizer.decode(out[f"r{i}"][0][:-1])), SCHEMA)


def test_random_schemas_finish_with_stop_and_every_such_output_validates(tiny_llama_dir, model, backend,
                                                                          tokenizer):
    schemas = [random_schema(i) for i in range(100)]
    runner = make_runner(tiny_llama_dir, model=model, num_blocks=512)
    runner.grammar = backend
    reqs, sched_reasons = {}, {}
    for i, schema in enumerate(schemas):
        spec = Structured(STRUCTURED_JSON, json.dumps(schema))
        for mode, sampling in (("greedy", _sampling(spec)), ("sampled", _sampling(spec, temperature=1.0, seed=i))):
            rid = f"{mode}-{i}"
            reqs[rid] = GenerationRequest(rid, [5, 17 + i, 99, 23], RequestParams(max_tokens=300, sampling=sampling))
    config = SchedulerConfig(block_size=16, max_model_len=512, max_num_seqs=256, max_num_batched_tokens=4096)
    sched = Scheduler(config, 512, 8, eos_token_ids=(EOS,))
    out: dict[str, list[int]] = {rid: [] for rid in reqs}
    for r in reqs.values():
        sched.add_request(r)
    while sched.has_work():
        plan = sched.schedule()
        if plan is None:
            continue
        result = runner.execute(plan)
        assert result.error is None, result.error
        for u in sched.update(result):
            for su in u.seqs:
                out[u.request_id] += su.new_token_ids
                if su.finish_reason is not None:
                    sched_reasons[u.request_id] = su.finish_reason
    stopped = [rid for rid, why in sched_reasons.items() if why == FinishReason.EOS]
    for mode in ("greedy", "sampled"):
        assert sum(rid.startswith(mode) for rid in stopped) >= 95, mode
    for rid in stopped:
        schema = schemas[int(rid.split("-")[1])]
        jsonschema.validate(json.loads(tokenizer.decode(out[rid][:-1])), schema)  # parses (strictly) and validates


def test_a_sequence_that_reaches_max_tokens_first_ends_by_length_with_the_text_as_generated(
        tiny_llama_dir, model, backend):
    runner = make_runner(tiny_llama_dir, model=model)
    runner.grammar = backend
    full, _ = _serve(runner, {"a": GenerationRequest("a", PROMPTS[0], RequestParams(80, _sampling(SPECS["json"])))})
    cut_at = len(full["a"][0]) // 2
    sched_cfg = dict(block_size=16, max_model_len=512)
    runner = make_runner(tiny_llama_dir, model=model)
    runner.grammar = backend
    sched = Scheduler(SchedulerConfig(**sched_cfg), 64, 16, eos_token_ids=(EOS,))
    sched.add_request(GenerationRequest("b", PROMPTS[0], RequestParams(cut_at, _sampling(SPECS["json"]))))
    reasons, tokens = [], []
    while sched.has_work():
        plan = sched.schedule()
        if plan is not None:
            for u in sched.update(runner.execute(plan)):
                for su in u.seqs:
                    tokens += su.new_token_ids
                    reasons.append(su.finish_reason)
    assert reasons[-1] == FinishReason.LENGTH and tokens == full["a"][0][:cut_at]


def _composition_reqs(n: int = 1) -> dict[str, GenerationRequest]:
    reqs = {}
    for kind, spec in SPECS.items():
        for i, prompt in enumerate(PROMPTS):
            sampling = _sampling(spec, temperature=0.8, seed=100 + i) if i % 2 else _sampling(spec)
            reqs[f"{kind}-{i}"] = GenerationRequest(f"{kind}-{i}", prompt, RequestParams(60, sampling, n=n))
    return reqs


@pytest.fixture(scope="module")
def alone(tiny_llama_dir, model, backend) -> dict[str, list[int]]:
    """Each request served alone, nothing else in its way: what every composition must reproduce."""
    out = {}
    for rid, req in _composition_reqs().items():
        runner = make_runner(tiny_llama_dir, model=model)
        runner.grammar = backend
        out[rid] = _serve(runner, {rid: req})[0][rid][0]
    return out


@pytest.mark.parametrize("case", ["batched", "chunked_prefill", "recompute", "swap", "prepare_ahead"])
def test_grammar_state_follows_the_sequence_through_batching_chunks_preemption_and_the_pipeline(
        tiny_llama_dir, model, backend, alone, case):
    blocks = {"recompute": 10, "swap": 10}.get(case, 128)
    runner = make_runner(tiny_llama_dir, model=model, num_blocks=blocks, num_cpu_blocks=64)
    runner.grammar = backend
    cfg = {"chunked_prefill": dict(max_num_batched_tokens=24), "recompute": dict(preemption_mode="recompute"),
           "swap": dict(preemption_mode="swap")}.get(case, {})
    if case == "prepare_ahead":  # two plans in flight, each prepared while the step before runs
        config = SchedulerConfig(block_size=16, max_model_len=512, max_num_seqs=256, max_num_batched_tokens=4096)
        sched = Scheduler(config, blocks, 64, eos_token_ids=(EOS,))
        out = serve_pipelined(runner, sched, _composition_reqs())
    else:
        out, sched = _serve(runner, _composition_reqs(), **cfg)
    if case in ("recompute", "swap"):
        assert sched.num_preemptions > 0  # (the grammar is rebuilt from the tokens, or survives the swap)
    assert {rid: o[0] for rid, o in out.items()} == alone


def test_parallel_choices_each_follow_the_grammar_and_choice_0_equals_the_request_alone(
        tiny_llama_dir, model, backend, alone, tokenizer):
    runner = make_runner(tiny_llama_dir, model=model, num_blocks=256)
    runner.grammar = backend
    reqs = {rid: r for rid, r in _composition_reqs(n=3).items() if rid.endswith("-1")}  # the seeded ones
    out, _ = _serve(runner, reqs)
    for rid, choices in out.items():
        assert len(choices) == 3 and choices[0] == alone[rid]
        if rid.startswith("json"):
            for c in (c for c in choices if c[-1] == EOS):  # (one that reached max_tokens is cut short)
                jsonschema.validate(json.loads(tokenizer.decode(c[:-1])), SCHEMA)
    assert any(len({tuple(c) for c in choices}) > 1 for choices in out.values()), "children draw on their own seeds"


def test_a_prefix_hit_does_not_change_the_constrained_output(tiny_llama_dir, model, backend, alone):
    runner = make_runner(tiny_llama_dir, model=model, num_blocks=128)
    runner.grammar = backend
    config = SchedulerConfig(block_size=16, max_model_len=512)
    sched = Scheduler(config, 128, 16, eos_token_ids=(EOS,))
    req = _composition_reqs()["json-2"]  # a 40-token prompt: two full blocks to share
    first = serve_requests(runner, sched, {"first": GenerationRequest("first", req.prompt_token_ids, req.params)})
    again = serve_requests(runner, sched, {"again": GenerationRequest("again", req.prompt_token_ids, req.params)})
    assert sched.prefix_cache_hit_tokens >= 32
    assert first["first"][0] == again["again"][0] == alone["json-2"]


def test_tensor_parallel_rank_0_constrains_what_the_group_samples(tiny_checkpoint, backend):
    path = tiny_checkpoint("llama", "tp")
    with tp_runner(path) as leader:
        leader.grammar = GrammarBackend.for_model(path, leader.model.cfg.vocab_size)
        reqs = _composition_reqs()
        tp_out, _ = _serve(leader, reqs)
        leader.settle()
    single = make_runner(path)
    single.grammar = GrammarBackend.for_model(path, single.model.cfg.vocab_size)
    assert tp_out == _serve(single, _composition_reqs())[0]


# ---------------------------------------------------------------- the matcher's own rules

def test_a_terminated_matcher_allows_only_end_tokens(backend, tokenizer):
    g = backend.track(SPECS["choice"], [EOS, 7], [])
    for tok in tokenizer.encode("yes").ids + [EOS]:
        g.accept(tok)

    class Row:
        grammar, seq_id = g, 1

    masks = backend.masks([Row()])
    assert masks.allowed(0).tolist() == [EOS, 7]


class _Row:
    def __init__(self, grammar) -> None:
        self.grammar, self.seq_id = grammar, 1


@pytest.mark.parametrize("spec", ["root ::= root", 'root ::= "a" stuck\nstuck ::= stuck'])
def test_a_grammar_that_allows_no_token_fails_its_row_as_the_requests_fault(backend, tokenizer, spec):
    """Its all-zero mask was applied and whatever was sampled broke the grammar: a failed step, which
    the API answered 500 (the openai client retries it) for a grammar that can never be served."""
    g = backend.track(Structured(STRUCTURED_GRAMMAR, spec), [EOS], [])
    if "stuck" in spec:
        g.accept(tokenizer.token_to_id("a"))
    good = backend.track(SPECS["choice"], [EOS], [])
    masks = backend.masks([_Row(None), _Row(g), _Row(good)])
    assert (masks.rows, masks.failed, masks.rejected) == ([2], {1: NO_TOKEN_ALLOWED}, {1})
    assert masks.allowed(2).numel() > 0  # the other constrained row is served


BAD_SPEC = Structured(STRUCTURED_JSON, json.dumps({"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}))


def _serve_failing(runner, reqs: dict[str, GenerationRequest]) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Serve until done, tolerating failed sequences: (request -> choice 0's tokens, failed
    request -> its error), every step's result checked by the real scheduler, no block left."""
    sched = Scheduler(SchedulerConfig(block_size=16, max_model_len=512), runner.kv.num_blocks, runner.kv.num_cpu_blocks,
                      eos_token_ids=(EOS,))
    out: dict[str, list[int]] = {rid: [] for rid in reqs}
    errors: dict[str, str] = {}
    for req in reqs.values():
        sched.add_request(req)

    def take(plan, result) -> None:
        if result.failed_seq_ids:
            assert result.sampled_seq_ids, "the step's other rows were sampled"
            assert "does not compile here" in result.error
            assert [r.seq_id for r in result.rejected] == result.failed_seq_ids  # the request's fault
        for upd in sched.update(result):
            if upd.error is not None:
                errors[upd.request_id] = upd.error
                assert upd.error_kind is ErrorKind.INVALID
            for seq in upd.seqs:
                out[upd.request_id].extend(seq.new_token_ids)
        sched.check_integrity()

    drive(runner, sched, take)
    assert sched.num_used_blocks == 0
    return out, errors


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_grammar_this_engine_cannot_compile_fails_its_sequence_alone(tiny_llama_dir, tiny_checkpoint, model,
                                                                      backend, ranks):
    """Its first sample fails it, naming why; the constrained and plain rows sampled in the same
    steps are served exactly as without it, and with tensor parallelism every rank drops it."""
    reqs = {"good": GenerationRequest("good", PROMPTS[0], RequestParams(12, _sampling(SPECS["choice"]))),
            "plain": GenerationRequest("plain", PROMPTS[2], RequestParams(12, SamplingParams(temperature=0.0)))}
    with_bad = {"bad": GenerationRequest("bad", PROMPTS[1], RequestParams(8, _sampling(BAD_SPEC))), **reqs}
    if ranks == 1:
        runner = make_runner(tiny_llama_dir, model=model)
        runner.grammar = backend
        out, errors = _serve_failing(runner, with_bad)
        single = make_runner(tiny_llama_dir, model=model)
        single.grammar = backend
        alone, _ = _serve_failing(single, reqs)
        assert not runner.seqs and not runner.dropped.ids
    else:
        path = tiny_checkpoint("llama", "tp")
        with tp_runner(path) as leader:
            leader.grammar = GrammarBackend.for_model(path, leader.model.cfg.vocab_size)
            out, errors = _serve_failing(leader, with_bad)
            leader.settle()
            assert not leader.seqs and not any(f.seqs for f in leader.followers)
            assert not leader.dropped.ids and not any(f.dropped.ids for f in leader.followers)  # freed everywhere
            alone, _ = _serve_failing(leader, reqs)
    assert list(errors) == ["bad"] and out["bad"] == []
    assert errors["bad"].startswith("structured outputs: the grammar does not compile here (xgrammar): ")
    assert {rid: out[rid] for rid in reqs} == alone and all(alone.values())


def test_forked_and_replayed_grammars_continue_from_their_tokens(backend, tokenizer):
    ids = tokenizer.encode('{"name": "ab').ids
    g = backend.track(SPECS["json"], [EOS], ids)  # registered again with these outputs (recompute, migration)
    child = g.fork()
    g.accept(tokenizer.token_to_id("c"))
    assert child.matcher() is not g.matcher()
    with pytest.raises(GrammarError):
        bad = backend.track(SPECS["json"], [EOS], tokenizer.encode("[").ids)
        bad.matcher()


def test_bounded_json_strings_cannot_hold_raw_control_characters(backend):
    raw = str(xgr.Grammar.from_json_schema(json.dumps({"type": "string", "maxLength": 3}), any_whitespace=False))
    assert _BOUNDED_STRING_CHARS in raw, "xgrammar changed how it writes bounded strings: drop the mend"
    assert _BOUNDED_STRING_CHARS not in json_schema_grammar(json.dumps({"type": "string", "maxLength": 3}))


def test_a_grammar_xgrammar_refuses_is_the_requests_fault_told_without_its_cpp_source_line(backend):
    with pytest.raises(GrammarError) as raised:
        backend.track(BAD_SPEC, [EOS], []).matcher()
    assert raised.value.rejected
    message = str(raised.value)
    assert message.startswith("the grammar does not compile here (xgrammar): ") and ".cc:" not in message
    assert not message.endswith("\n")
