"""An engine core holds each front's Submit to its own limits: a request past one fails alone (INVALID,
naming the field, the limit and the value), the front's other requests go on and no block is held;
a Submit past what the link carries for every deployment does not decode, and its front is dropped."""

from __future__ import annotations

import asyncio
import math
import sys
import time

import pytest
import zmq
import zmq.asyncio

from pagedserve.engine_api import ErrorKind, FinishReason, GenerationRequest, ModelInfo, RequestParams
from pagedserve.request_bounds import RequestLimits, ValidationError
from pagedserve.wire import (
    JSON_OBJECT_SCHEMA,
    MAX_SEQ_TOKENS,
    SamplingParams,
    Structured,
    WireError,
)
from pagedserve.wire import front_messages as m
from scheduler_svc.engine.front_link import FrontLink
from scheduler_svc.engine.submit_bounds import check_submit
from testing.fake_engine import running, settle
from testing.grpc_fakes import make_tokenizer

LIMITS = RequestLimits(max_n=4, max_beam_width=3, max_stop_strings=2, max_stop_string_len=5, max_stop_token_ids=2,
                       max_logprobs=5, max_logit_bias=2, max_structured_chars=40)
INFO = ModelInfo("m", "a", max_model_len=64, vocab_size=100, block_size=16, num_executors=1)
PROMPT = 20  # tokens: one full block of 16


def _submit(prompt_len: int = PROMPT, **params) -> m.Submit:
    sampling = params.pop("sampling", {})
    p = RequestParams(max_tokens=params.pop("max_tokens", 8), sampling=SamplingParams(**sampling), **params)
    req = GenerationRequest("f:r", [], p, prompt_block_hashes=[b"\1" * 32] * (prompt_len // 16))
    return m.Submit(req, m.pack_ids([1] * prompt_len), 0.0)


def _resumed(outputs, finished=(), **params) -> m.Submit:
    msg = _submit(**params)
    msg.resume_outputs, msg.resume_finished = [list(o) for o in outputs], list(finished)
    return msg


def _prompt(n: int, **params) -> m.Submit:
    msg = _submit(n, **params)
    msg.request.prompt_block_hashes = None
    return msg


def _hashes(k: int) -> m.Submit:
    msg = _submit()
    msg.request.prompt_block_hashes = [b"\1" * 32] * k
    return msg


def _structured(spec: str, **params) -> m.Submit:
    return _submit(sampling={"structured": Structured(1, spec)}, **params)


# (just inside, just outside, the error): the core's limits (LIMITS) and its executors' model (INFO)
BOUNDS = {
    "n": (_submit(n=4), _submit(n=5), "sampling.n: must be in [1, 4] (got 5)"),
    "beam_width": (_submit(beam_width=3), _submit(beam_width=4), "sampling.beam_width: must be in [1, 3] (got 4)"),
    "n-with-beams": (_submit(n=2), _submit(n=2, beam_width=2), "sampling.n: must be 0 or 1 with beam search "
                     "(beam_width=2 returns that many beams as the choices); got n=2"),
    "beams-with-logprobs": (_submit(beam_width=2), _submit(beam_width=2, sampling={"want_logprobs": True}),
                            "sampling.logprobs: cannot be combined with beam search (beam_width=2): beams report "
                            "no per-token log-probs"),
    "presence-penalty": (_submit(sampling={"presence_penalty": 2.0}), _submit(sampling={"presence_penalty": 2.5}),
                         "sampling.presence_penalty: must be in [-2, 2] (got 2.5)"),
    "frequency-penalty": (_submit(sampling={"frequency_penalty": -2.0}),
                          _submit(sampling={"frequency_penalty": -1e300}),
                          "sampling.frequency_penalty: must be in [-2, 2] (got -1e+300)"),
    "stop-count": (_submit(stop=["a", "b"]), _submit(stop=["a", "b", "c"]),
                   "sampling.stop: at most 2 distinct stop strings (got 3)"),
    "stop-length": (_submit(stop=["abcde"]), _submit(stop=["x", "abcdef"]),
                    "sampling.stop[1]: must be at most 5 characters (got 6)"),
    "stop-token-ids-count": (_submit(stop_token_ids=[1, 2]), _submit(stop_token_ids=[1, 2, 3]),
                             "sampling.stop_token_ids: at most 2 distinct ids (got 3)"),
    "stop-token-ids-vocab": (_submit(stop_token_ids=[99]), _submit(stop_token_ids=[100]),
                             "sampling.stop_token_ids[0]: must be a token id in [0, vocab_size=100) (got 100)"),
    "logprobs": (_submit(sampling={"want_logprobs": True, "logprobs": 5}),
                 _submit(sampling={"want_logprobs": True, "logprobs": 6}), "sampling.logprobs: must be in [0, 5] (got 6)"),
    "prompt-logprobs": (_submit(sampling={"prompt_logprobs": 5}), _submit(sampling={"prompt_logprobs": 6}),
                        "sampling.prompt_logprobs: must be in [0, 5] (got 6)"),
    "logit-bias-count": (_submit(sampling={"logit_bias": [(1, 1.0), (2, 1.0)]}),
                         _submit(sampling={"logit_bias": [(1, 1.0), (2, 1.0), (3, 1.0)]}),
                         "sampling.logit_bias: at most 2 entries (got 3)"),
    "logit-bias-vocab": (_submit(sampling={"logit_bias": [(99, 1.0)]}), _submit(sampling={"logit_bias": [(100, 1.0)]}),
                         "sampling.logit_bias[100]: must name a token id in [0, vocab_size=100) (got 100)"),
    "logit-bias-value": (_submit(sampling={"logit_bias": [(1, 100.0)]}), _submit(sampling={"logit_bias": [(1, 100.5)]}),
                         "sampling.logit_bias[1]: must be in [-100, 100] (got 100.5)"),
    "min-tokens": (_submit(sampling={"min_tokens": 8}), _submit(sampling={"min_tokens": 9}),
                   "sampling.min_tokens: must be in [0, 8] (got 9)"),
    "beam-candidates": (_submit(), _submit(sampling={"beam_candidates": 2}),
                        "sampling.beam_candidates: is the scheduler's to set; must be 0 (got 2)"),
    "structured-length": (_structured("x" * 40), _structured("x" * 41),
                          "sampling.structured: must be at most 40 characters (got 41)"),
    "structured-with-beams": (_structured("x"), _structured("x", beam_width=2),
                              "sampling.structured: cannot be combined with beam search (beam_width=2)"),
    "end-token-ids": (_submit(sampling={"end_token_ids": [99]}), _submit(sampling={"end_token_ids": [100]}),
                      "sampling.end_token_ids[0]: must be a token id in [0, vocab_size=100) (got 100)"),
    "max-tokens": (_submit(max_tokens=44), _submit(max_tokens=45), "sampling.max_tokens: This model's maximum context "
                   "length is 64 tokens. However, you requested 65 tokens (20 in the prompt, 45 in the completion): "
                   "at most 44 can be generated after this prompt. Please reduce the length of the prompt or "
                   "completion."),
    "prompt-length": (_prompt(63, max_tokens=1), _prompt(64, max_tokens=1), "prompt_token_ids: This model's "
                      "maximum context length is 64 tokens. However, the prompt has 64 tokens, which leaves no room "
                      "to generate: at most 63 are allowed. Please reduce the length of the prompt."),
    "prompt-empty": (_prompt(1), _prompt(0), "prompt_token_ids: must not be empty"),
    "block-hashes": (_hashes(1), _hashes(2), "prompt_block_hashes: must hold one hash per full block of the prompt: "
                     "1 for 20 tokens in blocks of 16 (got 2)"),
    "resume-count": (_resumed([[1], [2]], n=2), _resumed([[1]], n=2),
                     "resume_outputs: must hold one output per choice: 2 (got 1)"),
    "resume-finished-count": (_resumed([[1]], [None]), _resumed([[1]], [None, None]),
                              "resume_finished: must hold at most one finish reason per choice: 1 (got 2)"),
    "resume-running-length": (_resumed([[1] * 7]), _resumed([[1] * 8]),
                              "resume_outputs[0]: a choice still running must hold fewer than max_tokens=8 tokens "
                              "(got 8)"),
    "resume-finished-length": (_resumed([[1] * 8], [FinishReason.LENGTH]), _resumed([[1] * 9], [FinishReason.LENGTH]),
                               "resume_outputs[0]: must hold at most max_tokens=8 tokens (got 9)"),
    "resume-vocab": (_resumed([[99]]), _resumed([[1, 100]]),
                     "resume_outputs[0][1]: must be a token id in [0, vocab_size=100) (got 100)"),
}


@pytest.mark.parametrize("inside, outside, error", BOUNDS.values(), ids=BOUNDS.keys())
def test_each_bound_passes_just_inside_and_names_field_and_limit_just_outside(inside, outside, error):
    for msg in (inside, outside):  # (what the core checks is what decoded)
        assert m.TIER.decode(m.TIER.encode(msg), accept=m.FROM_FRONT) == msg
    check_submit(inside, m.num_packed(inside.prompt_ids), LIMITS, INFO)
    with pytest.raises(ValidationError) as exc:
        check_submit(outside, m.num_packed(outside.prompt_ids), LIMITS, INFO)
    assert str(exc.value) == error


def test_a_moved_request_runs_to_the_length_fixed_where_it_runs():
    """max_tokens past the context is checked on a fresh Submit (as its front did) but not on a moved
    one: it goes on as a migration does, to the length the core it lands on can hold."""
    check_submit(_resumed([[1]], max_tokens=60), PROMPT, LIMITS, INFO)


def test_without_an_executor_the_limits_are_checked_and_the_model_is_not():
    check_submit(_submit(stop_token_ids=[1000]), PROMPT, LIMITS, None)  # (no vocabulary known: it fails for want of one)
    with pytest.raises(ValidationError, match=r"^sampling.n: must be in \[1, 4\] \(got 5\)$"):
        check_submit(_submit(n=5), PROMPT, LIMITS, None)


def test_a_json_object_spec_passes_whatever_the_structured_limit():
    check_submit(_structured(JSON_OBJECT_SCHEMA), PROMPT, RequestLimits(max_structured_chars=1), INFO)


# ------------------------------------------------------------------ what does not decode

def _field(msg: m.Submit, path: str, value) -> m.Submit:
    *parents, last = path.split(".")
    obj = msg
    for name in parents:
        obj = getattr(obj, name)
    setattr(obj, last, value)
    return msg


# (field, just inside, just outside, what the codec says): a constant of the link
WIRE = {
    "request_id": ("request.request_id", "f:" + "r" * 510, "f:" + "r" * 511,
                   "Expected `str` of length <= 512 - at `$[0].request_id` (in submit)"),
    "prompt_token_ids": ("request.prompt_token_ids", [], [1],
                         "Expected `array` of length <= 0 - at `$[0].prompt_token_ids` (in submit)"),
    "max_tokens-low": ("request.params.max_tokens", 1, 0, "Expected `int` >= 1 - at `$[0].params.max_tokens` (in submit)"),
    "max_tokens-high": ("request.params.max_tokens", MAX_SEQ_TOKENS, MAX_SEQ_TOKENS + 1,
                        "Expected `int` <= 4194304 - at `$[0].params.max_tokens` (in submit)"),
    "n-low": ("request.params.n", 1, 0, "Expected `int` >= 1 - at `$[0].params.n` (in submit)"),
    "n-high": ("request.params.n", 4096, 4097, "Expected `int` <= 4096 - at `$[0].params.n` (in submit)"),
    "beam_width": ("request.params.beam_width", 512, 513,
                   "Expected `int` <= 512 - at `$[0].params.beam_width` (in submit)"),
    "length_penalty": ("request.params.length_penalty", 10.0, 10.5,
                       "Expected `float` <= 10.0 - at `$[0].params.length_penalty` (in submit)"),
    "length_penalty-nan": ("request.params.length_penalty", -10.0, math.nan,
                           "Expected `float` >= -10.0 - at `$[0].params.length_penalty` (in submit)"),
    "stop-count": ("request.params.stop", ["s"] * 4096, ["s"] * 4097,
                   "Expected `array` of length <= 4096 - at `$[0].params.stop` (in submit)"),
    "stop-length": ("request.params.stop", ["s" * 4096], ["s" * 4097],
                    "Expected `str` of length <= 4096 - at `$[0].params.stop[0]` (in submit)"),
    "stop-empty": ("request.params.stop", ["s"], [""],
                   "Expected `str` of length >= 1 - at `$[0].params.stop[0]` (in submit)"),
    "stop_token_ids-count": ("request.params.stop_token_ids", [1] * 4096, [1] * 4097,
                             "Expected `array` of length <= 4096 - at `$[0].params.stop_token_ids` (in submit)"),
    "stop_token_ids-negative": ("request.params.stop_token_ids", [0], [-1],
                                "Expected `int` >= 0 - at `$[0].params.stop_token_ids[0]` (in submit)"),
    "block-hash-length": ("request.prompt_block_hashes", [b"\1" * 32], [b"\1" * 33],
                          "Expected `bytes` of length <= 32 - at `$[0].prompt_block_hashes[0]` (in submit)"),
    "lora": ("request.lora", "a" * 128, "a" * 129, "Expected `str` of length <= 128 - at `$[0].lora` (in submit)"),
    "resume_outputs-count": ("resume_outputs", [[]] * 4096, [[]] * 4097,
                             "Expected `array` of length <= 4096 (at submit.resume_outputs)"),
    "resume_outputs-id": ("resume_outputs", [[2**31 - 1]], [[2**31]],
                          "Expected `int` <= 2147483647 (at submit.resume_outputs[0][0])"),
    "resume_finished": ("resume_finished", [int(FinishReason.ABORTED)], [5],
                        "Expected `int` <= 4 (at submit.resume_finished[0])"),
}


@pytest.mark.parametrize("path, inside, outside, error", WIRE.values(), ids=WIRE.keys())
def test_what_the_link_never_carries_does_not_decode(path, inside, outside, error):
    ok = _field(_submit(), path, inside)
    assert m.TIER.decode(m.TIER.encode(ok), accept=m.FROM_FRONT) == ok
    frame = m.TIER.encode(_field(_submit(), path, outside))
    with pytest.raises(WireError) as exc:
        m.TIER.decode(frame, accept=m.FROM_FRONT)
    assert str(exc.value) == "malformed Submit: " + error


# ------------------------------------------------------------------ on a live core

def _bad(rid: str, **params) -> m.Submit:
    p = RequestParams(max_tokens=8, sampling=SamplingParams(temperature=0.0), ignore_eos=True, **params)
    return m.Submit(GenerationRequest(rid, [], p), m.pack_ids(list(range(3, 40))), 0.0)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ipc:// endpoints")
def test_a_request_past_the_cores_limits_fails_alone_and_the_fronts_others_finish(tmp_path):
    async def main():
        async with running(make_tokenizer(), 1) as (engine, _):
            link = FrontLink(engine.core, f"ipc://{tmp_path}/front.sock", limits=RequestLimits(max_n=2))
            await link.start()
            sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(link.endpoint)
            try:
                await sock.send(m.TIER.encode(m.FrontHello("f", m.TIER_VERSION)))
                assert m.TIER.decode(await sock.recv()).accepted
                for msg in (_bad("f:ok-1", n=2), _bad("f:bad", n=3), _bad("f:ok-2"),
                            _bad("f:bad-stop", stop=[f"s{i}" for i in range(17)])):
                    await sock.send(m.TIER.encode(msg))
                ended: dict[str, object] = {}
                deadline = time.monotonic() + 30
                while len(ended) < 4:
                    assert time.monotonic() < deadline, f"only {sorted(ended)} ended"
                    msg = m.TIER.decode(await asyncio.wait_for(sock.recv(), 30))
                    if isinstance(msg, m.Updates):
                        ended.update((u.request_id, u) for u in msg.updates if u.finished)
                bad, stop = ended["f:bad"], ended["f:bad-stop"]
                assert (bad.error_kind, bad.error) == (ErrorKind.INVALID, "sampling.n: must be in [1, 2] (got 3)")
                assert (stop.error_kind, stop.error) == (ErrorKind.INVALID,
                                                         "sampling.stop: at most 16 distinct stop strings (got 17)")
                assert ended["f:ok-1"].error is None and ended["f:ok-2"].error is None
                assert link.fronts  # the front, and every other request it holds, stays
                await settle(engine)  # each scheduler's check_integrity(), and no block held
            finally:
                sock.close()
                await link.close()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_a_front_limit_past_the_link_is_refused_at_start():
    with pytest.raises(ValueError, match=r"RequestLimits.max_n must be an integer in \[1, 4096\], what the links carry"):
        RequestLimits(max_n=4097)
