"""Edge validation: GenerateRequest -> GenerationRequest, limits at and past their bounds."""

from __future__ import annotations

import dataclasses
import math

import msgspec
import pytest

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.wire import SamplingParams
from scheduler_svc.front.input.request_fields import OPTIONAL_SAMPLING, RequestFields, fields_from_proto
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.front.input.validation import (
    GREEDY_TEMPERATURE_EPS,
    MAX_SEED,
    ValidationError,
    validate_generate_request,
    validate_request,
)
from testing.grpc_fakes import make_tokenizer, model_info

LIMITS = ServerLimits(max_n=4, max_beam_width=3, max_stop_strings=2, max_stop_string_len=5,
                      max_stop_token_ids=2, max_logprobs=5, default_max_tokens=16)


def validate(limits: ServerLimits = LIMITS, max_model_len: int = 64, **fields):
    tok = make_tokenizer()
    sampling = pb.SamplingParams(**fields.pop("sampling", {}))
    fields.setdefault("prompt", "Hello")
    if fields["prompt"] is None:
        del fields["prompt"]
    req = pb.GenerateRequest(sampling=sampling, **fields)
    return validate_generate_request(req, model_info(tok, max_model_len), limits,
                                     lambda text: tok.encode(text).ids)


def refused(field: str, **fields) -> str:
    with pytest.raises(ValidationError) as info:
        validate(**fields)
    assert info.value.field == field
    return str(info.value)


@pytest.mark.parametrize("name,limit", [("n", 4), ("beam_width", 3), ("logprobs", 5)])
def test_integer_limits_are_inclusive(name, limit):
    validate(sampling={name: limit})
    msg = refused(f"sampling.{name}", sampling={name: limit + 1})
    assert str(limit) in msg and str(limit + 1) in msg


def test_stop_limits_are_inclusive():
    validate(sampling={"stop": ["abcde", "x"], "stop_token_ids": [1, 2]})
    refused("sampling.stop", sampling={"stop": ["a", "b", "c"]})
    refused("sampling.stop[0]", sampling={"stop": ["abcdef"]})
    refused("sampling.stop_token_ids", sampling={"stop_token_ids": [1, 2, 3]})


def test_unset_n_and_beam_width_mean_one_and_beam_allows_n_one():
    p = validate().params
    assert (p.n, p.beam_width) == (1, 1)
    p = validate(sampling={"n": 1, "beam_width": 3, "length_penalty": 0.5, "early_stopping": True}).params
    assert (p.n, p.beam_width, p.length_penalty, p.early_stopping) == (1, 3, 0.5, True)


def test_max_tokens_default_is_capped_by_the_context_left():
    assert validate().params.max_tokens == 16
    ids = [0] + [5] * 59  # 60 tokens of 64
    assert validate(prompt=None, prompt_token_ids=ids).params.max_tokens == 4
    assert validate(prompt=None, prompt_token_ids=ids, sampling={"max_tokens": 4}).params.max_tokens == 4
    msg = refused("sampling.max_tokens", prompt=None, prompt_token_ids=ids, sampling={"max_tokens": 5})
    assert "60" in msg and "65" in msg and "64" in msg
    refused("prompt_token_ids", prompt=None, prompt_token_ids=[5] * 64)  # no room left at all


def test_prompt_is_tokenized_with_special_tokens():
    tok = make_tokenizer()
    req = validate(prompt="naïve café 🙂")
    assert req.prompt_token_ids == tok.encode("naïve café 🙂").ids and req.prompt_token_ids[0] == 0


def test_temperature_near_zero_is_greedy():
    assert validate(sampling={"temperature": GREEDY_TEMPERATURE_EPS / 2}).params.sampling.temperature == 0.0
    assert validate(sampling={"temperature": 0.0}).params.sampling.temperature == 0.0
    assert validate(sampling={"temperature": 1.5}).params.sampling.temperature == 1.5


@pytest.mark.parametrize("field,ok,bad", [
    ("top_p", [1.0, 1e-6], [0.0, -0.5, 1.01, math.nan]),
    ("min_p", [0.0, 1.0], [-1e-3, 1.01, math.nan]),
    ("presence_penalty", [-2.0, 2.0], [-2.01, 2.01, math.nan]),
    ("frequency_penalty", [-2.0, 0.0, 2.0], [-2.5, math.inf]),
    ("repetition_penalty", [0.01, 1.0, 10.0], [0.0, -1.0, math.inf, math.nan]),
    ("length_penalty", [-1.0, 0.0, 2.0], [math.inf, -math.inf, math.nan]),
    ("top_k", [-1, 0, 1, 100000], [-2]),
])
def test_range_boundaries(field, ok, bad):
    for value in ok:
        validate(sampling={field: value})
    for value in bad:
        refused(f"sampling.{field}", sampling={field: value})


def test_logprobs_unset_zero_and_k():
    assert not validate().params.sampling.want_logprobs
    p = validate(sampling={"logprobs": 0}).params
    assert (p.sampling.want_logprobs, p.sampling.logprobs) == (True, 0)
    p = validate(sampling={"logprobs": 3}).params
    assert (p.sampling.want_logprobs, p.sampling.logprobs) == (True, 3)


def test_a_seed_is_any_64_bit_value_whatever_n():
    # (choice i samples with (seed + i) mod 2**64: scheduler lifecycle.seeded)
    assert validate(sampling={"seed": MAX_SEED, "n": 4}).params.sampling.seed == MAX_SEED


def test_duplicate_stops_collapse_and_request_id_is_kept():
    req = validate(request_id="abc", sampling={"stop": ["x", "x"], "stop_token_ids": [3, 3]})
    assert (req.request_id, req.params.stop, req.params.stop_token_ids) == ("abc", ["x"], [3])


def test_duplicates_collapse_before_the_limits_count_them():
    # LIMITS: 2 stop strings, 2 stop token ids; the raw lists are bounded at 4 x those.
    req = validate(sampling={"stop": ["x", "y"] * 4, "stop_token_ids": [3, 5] * 4})
    assert (req.params.stop, req.params.stop_token_ids) == (["x", "y"], [3, 5])
    assert refused("sampling.stop", sampling={"stop": ["x", "y", "z", "x"]}) == \
        "sampling.stop: at most 2 distinct stop strings (got 3)"
    assert refused("sampling.stop_token_ids", sampling={"stop_token_ids": [3, 5, 7, 3]}) == \
        "sampling.stop_token_ids: at most 2 distinct ids (got 3)"
    assert refused("sampling.stop", sampling={"stop": ["x"] * 9}) == \
        "sampling.stop: at most 8 entries as sent, duplicates included (got 9)"
    assert refused("sampling.stop_token_ids", sampling={"stop_token_ids": [3] * 9}) == \
        "sampling.stop_token_ids: at most 8 entries as sent, duplicates included (got 9)"


def test_the_default_limits_take_the_audits_duplicate_lists():
    req = validate(limits=ServerLimits(), sampling={"stop": ["x"] * 20, "stop_token_ids": [5] * 100})
    assert (req.params.stop, req.params.stop_token_ids) == (["x"], [5])
    refused("request_id", request_id="a\nb")


def test_tokenizer_ids_outside_the_model_vocabulary_are_refused():
    tok = make_tokenizer()
    req = pb.GenerateRequest(prompt="Hello")
    info = model_info(tok)
    info.vocab_size = 10  # a tokenizer larger than the model's embedding table
    with pytest.raises(ValidationError) as err:
        validate_generate_request(req, info, LIMITS, lambda t: tok.encode(t).ids)
    assert err.value.field.startswith("prompt[") and "vocab_size=10" in str(err.value)


def test_prompt_that_tokenizes_to_nothing_is_refused():
    req = pb.GenerateRequest(prompt="   ")
    with pytest.raises(ValidationError, match="0 tokens"):
        validate_generate_request(req, model_info(make_tokenizer()), LIMITS, lambda t: [])


@pytest.mark.parametrize("bad", [{"max_n": 0}, {"max_logprobs": -1}, {"default_max_tokens": 1.5},
                                 {"max_concurrent_calls": -1}, {"auth_failure_burst": 0}])
def test_server_limits_are_checked(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        ServerLimits(**bad)


@pytest.mark.parametrize("bad, message", [
    ({"max_logprobs": 1025}, "ServerLimits.max_logprobs must be an integer in [0, 1024], what the links carry "
                             "(got 1025)"),
    ({"max_beam_width": 513}, "ServerLimits.max_beam_width must be an integer in [1, 512], what the links carry "
                              "(got 513)"),
    ({"max_n": 4097}, "ServerLimits.max_n must be an integer in [1, 4096], what the links carry (got 4097)"),
    ({"max_stop_strings": 4097}, "ServerLimits.max_stop_strings must be an integer in [0, 4096], what the links "
                                 "carry (got 4097)"),
    ({"max_stop_string_len": 4097}, "ServerLimits.max_stop_string_len must be an integer in [1, 4096], what the "
                                    "links carry (got 4097)"),
    ({"max_stop_token_ids": 4097}, "ServerLimits.max_stop_token_ids must be an integer in [0, 4096], what the "
                                   "links carry (got 4097)"),
    ({"max_structured_chars": (1 << 20) + 1}, "ServerLimits.max_structured_chars must be an integer in "
                                              "[0, 1048576], what the links carry (got 1048577)"),
])
def test_server_limits_stay_within_what_the_wire_carries(bad, message):
    """A request at a limit past the wire's bound would make a Submit the engine core refuses (dropping
    its front, every request on it) or a plan every executor refuses."""
    with pytest.raises(ValueError) as exc:
        ServerLimits(**bad)
    assert str(exc.value) == message
    at_bound = ServerLimits(max_logprobs=1024, max_beam_width=512)
    sp = validate(limits=at_bound, sampling={"logprobs": 1024, "prompt_logprobs": 1024}).params.sampling
    wire_sampling = msgspec.msgpack.decode(msgspec.msgpack.encode(sp), type=SamplingParams)
    assert (wire_sampling.logprobs, wire_sampling.prompt_logprobs) == (1024, 1024)


def test_zero_limits_turn_features_off():
    off = ServerLimits(max_logprobs=0, max_stop_strings=0, max_stop_token_ids=0)
    sp = validate(limits=off, sampling={"logprobs": 0}).params.sampling
    assert sp.want_logprobs and sp.logprobs == 0  # the sampled token's only
    refused("sampling.logprobs", limits=off, sampling={"logprobs": 1})
    refused("sampling.stop", limits=off, sampling={"stop": ["x"]})
    refused("sampling.stop_token_ids", limits=off, sampling={"stop_token_ids": [2]})


def test_server_limits_to_proto():
    msg = LIMITS.to_proto()
    assert (msg.max_n, msg.max_beam_width, msg.max_stop_strings, msg.max_stop_string_len,
            msg.max_stop_token_ids, msg.max_logprobs, msg.default_max_tokens) == (4, 3, 2, 5, 2, 5, 16)


@pytest.mark.parametrize("penalty", [1000.0, 300.0, -11.0, 3e38, -3e38])
def test_length_penalty_is_bounded_so_beam_scores_stay_finite(penalty):
    msg = refused("sampling.length_penalty", sampling={"beam_width": 2, "length_penalty": penalty})
    assert "[-10, 10]" in msg
    assert validate(sampling={"beam_width": 2, "length_penalty": -10.0}).params.length_penalty == -10.0


def test_a_request_that_can_never_fit_an_executor_pool_is_refused_at_the_edge():
    tok = make_tokenizer()
    info = dataclasses.replace(model_info(tok, 4096), max_request_blocks=100)  # 1600 tokens at once

    def check(**sampling):
        req = pb.GenerateRequest(prompt_token_ids=[5] * 10, sampling=pb.SamplingParams(**sampling))
        return validate_generate_request(req, info, LIMITS, lambda text: tok.encode(text).ids)

    assert check(max_tokens=1590).params.max_tokens == 1590  # 100 blocks: fits
    for sampling, field in [({"max_tokens": 1591}, "sampling.max_tokens"),
                            ({"n": 4, "max_tokens": 500}, "sampling.n"),
                            ({"beam_width": 3, "max_tokens": 600}, "sampling.beam_width")]:
        with pytest.raises(ValidationError) as e:
            check(**sampling)
        assert e.value.field == field and "the largest executor pool holds 100" in str(e.value)
    # Without max_tokens the default (chat: the whole context) shrinks to what the pool holds.
    chat_default = validate_request(RequestFields(prompt_token_ids=[5] * 10, n=4), info, LIMITS, lambda t: [],
                                    default_max_tokens=4096)
    assert chat_default.params.max_tokens == 100 // 4 * 16 - 10


def test_proto_presence_becomes_none_and_set_zeros_stay():
    f = fields_from_proto(pb.GenerateRequest(prompt="x", sampling=pb.SamplingParams(top_k=0, seed=0)))
    assert (f.top_k, f.seed) == (0, 0)
    assert all(getattr(f, name) is None for name in OPTIONAL_SAMPLING if name not in ("top_k", "seed"))
    assert fields_from_proto(pb.GenerateRequest(prompt_token_ids=[1])).prompt is None


def test_both_fronts_share_the_checks_and_a_front_may_set_its_own_default_max_tokens():
    tok = make_tokenizer()
    info = model_info(tok, 64)
    ids = [5] * 10

    def check(**kw):
        return validate_request(RequestFields(prompt_token_ids=ids, **kw), info, LIMITS, lambda t: [],
                                default_max_tokens=10**9)

    assert check().params.max_tokens == 54  # the whole context left, not LIMITS.default_max_tokens
    assert check(max_tokens=3).params.max_tokens == 3
    with pytest.raises(ValidationError) as err:
        check(seed=-1)  # a JSON front can send what proto's uint64 could not
    assert (err.value.field, err.value.detail) == ("sampling.seed", f"must be in [0, {MAX_SEED}] (got -1)")
    check(top_k=2**31 - 1)
    assert check(top_k=-1).params.sampling.top_k == 0  # vLLM's "off", as 0, on both fronts
    with pytest.raises(ValidationError) as err:
        check(top_k=-2)
    assert (err.value.field, err.value.detail) == ("sampling.top_k",
                                                   "must be -1 or 0 (off) or in [1, 2147483647] (got -2)")
    with pytest.raises(ValidationError, match="sampling.top_k"):
        check(top_k=2**31)  # the executor link carries int32; proto's int32 bounded it before


# ---------------------------------------------------------------- structured outputs, logit bias, min_tokens

@pytest.mark.parametrize("so,kind,spec", [
    ({"json_schema": '{"type": "object", "properties": {"a": {"enum": [1, 2]}}}'}, 1,
     '{"type":"object","properties":{"a":{"enum":[1,2]}}}'),
    ({"json_object": True}, 1, '{"type":"object"}'),
    ({"regex": r"\d{3}"}, 2, r"\d{3}"),
    ({"choice": {"values": ["a", "b"]}}, 3, '["a", "b"]'),
    ({"grammar": 'root ::= "x"+'}, 4, 'root ::= "x"+'),
])
def test_each_structured_output_becomes_one_spec_that_ends_with_eos(so, kind, spec):
    sp = validate(sampling={"structured_outputs": pb.StructuredOutputs(**so)}).params.sampling
    assert (sp.structured.kind, sp.structured.spec) == (kind, spec) and sp.end_token_ids == [1]


@pytest.mark.parametrize("so,field,words", [
    ({"json_schema": "{not json"}, "sampling.structured_outputs.json_schema", "not valid JSON"),
    ({"json_schema": '"a string"'}, "sampling.structured_outputs.json_schema", "JSON object"),
    ({"json_schema": "[" * 20000}, "sampling.structured_outputs.json_schema", "nested more than 64 levels"),
    ({"json_schema": '{"type": "wizard"}'}, "sampling.structured_outputs.json_schema", "wizard"),
    ({"json_schema": '{"$ref": "#/$defs/nowhere"}'}, "sampling.structured_outputs.json_schema", "nowhere"),
    ({"json_schema": '{"type": "string", "minLength": 3, "maxLength": 2}'}, "sampling.structured_outputs.json_schema",
     "minLength (3) is greater than maxLength (2)"),
    ({"regex": "(a"}, "sampling.structured_outputs.regex", "unclosed group"),
    ({"regex": "(?<=a)b"}, "sampling.structured_outputs.regex", "look-around"),
    ({"grammar": "root ::= undefined_rule"}, "sampling.structured_outputs.grammar", "undefined_rule"),
    ({"choice": {"values": []}}, "sampling.structured_outputs.choice", "at least one"),
    ({"choice": {"values": ["a", ""]}}, "sampling.structured_outputs.choice[1]", "non-empty"),
    ({}, "sampling.structured_outputs", "exactly one"),
])
def test_an_invalid_spec_is_refused_naming_its_field_before_anything_is_scheduled(so, field, words):
    assert words in refused(field, sampling={"structured_outputs": pb.StructuredOutputs(**so)})


def test_structured_outputs_bounds_and_what_they_cannot_be_combined_with():
    big = '{"type": "object", "description": "' + "x" * 100 + '"}'
    limits = dataclasses.replace(LIMITS, max_structured_chars=64)
    with pytest.raises(ValidationError, match="at most 64 characters"):
        validate(limits, sampling={"structured_outputs": pb.StructuredOutputs(json_schema=big)})
    so = pb.StructuredOutputs(json_object=True)
    assert "beam search" in refused("sampling.structured_outputs", sampling={"structured_outputs": so, "beam_width": 2})
    assert "ignore_eos" in refused("sampling.structured_outputs", sampling={"structured_outputs": so, "ignore_eos": True})
    off = dataclasses.replace(LIMITS, max_structured_chars=0)
    with pytest.raises(ValidationError, match="at most 0 characters"):
        validate(off, sampling={"structured_outputs": pb.StructuredOutputs(regex="a")})


def test_logprobs_with_beam_search_are_refused_not_dropped():
    """Beams report no per-token log-probs: asked for, they would silently be missing."""
    msg = refused("sampling.logprobs", sampling={"logprobs": 0, "beam_width": 2})
    assert msg == ("sampling.logprobs: cannot be combined with beam search (beam_width=2): beams report "
                   "no per-token log-probs")
    assert validate(sampling={"logprobs": 2, "beam_width": 1}).params.sampling.logprobs == 2  # (1: no beams)
    assert validate(sampling={"prompt_logprobs": 1, "beam_width": 2}).params.beam_width == 2  # the prompt's: fine


def test_logit_bias_min_tokens_prompt_logprobs_and_stop_strings_in_output():
    g = validate(sampling={"logit_bias": {5: -100.0, 7: 2.5}, "min_tokens": 3, "max_tokens": 8, "prompt_logprobs": 2,
                           "include_stop_str_in_output": True, "stop_token_ids": [9]})
    sp = g.params.sampling
    assert sp.logit_bias == [(5, -100.0), (7, 2.5)] and sp.min_tokens == 3 and sp.prompt_logprobs == 2
    assert sp.end_token_ids == [1, 9] and g.params.include_stop_str_in_output
    assert validate().params.sampling.end_token_ids == []  # nothing needs them: not sent
    assert validate(sampling={"min_tokens": 2, "ignore_eos": True, "max_tokens": 4}).params.sampling.end_token_ids == []
    refused("sampling.logit_bias[5]", sampling={"logit_bias": {5: 100.5}})
    refused("sampling.logit_bias[9999]", sampling={"logit_bias": {9999: 1.0}})
    assert "at most 2 entries" in refused("sampling.logit_bias", limits=dataclasses.replace(LIMITS, max_logit_bias=2),
                                          sampling={"logit_bias": {1: 1.0, 2: 1.0, 3: 1.0}})
    refused("sampling.min_tokens", sampling={"min_tokens": 9, "max_tokens": 8})
    refused("sampling.prompt_logprobs", sampling={"prompt_logprobs": 6})


def test_the_logprobs_mode_is_carried_to_the_executor():
    tok = make_tokenizer()
    req = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(logprobs=1))
    fields = fields_from_proto(req)
    raw = validate_request(fields, model_info(tok), LIMITS, lambda t: tok.encode(t).ids)
    processed = validate_request(fields_from_proto(req), model_info(tok), LIMITS, lambda t: tok.encode(t).ids,
                                 logprobs_mode="processed_logprobs")
    assert not raw.params.sampling.processed_logprobs and processed.params.sampling.processed_logprobs
