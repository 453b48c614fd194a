"""What an engine core checks of a front's ``Submit`` before it admits the request: its own limits.

A front validated the request against its limits and the model (pagedserve/request_bounds.py), but
a front is another process: perhaps a Deployment of its own with other flags, perhaps broken. The
link's types bound what decodes at all (``Meta`` on ``GenerationRequest``, ``RequestParams``,
``SamplingParams`` and ``Submit``: what no deployment serves, and what a frame that breaks them
costs its front: the core drops it). Within those, this holds the request to the core's own
:class:`RequestLimits` (its command line's ``--max-n`` and the rest) and to what its executors
serve (vocabulary, context, block size), with the checks and messages a front's validator uses.
A request that breaks one fails alone, ``ErrorKind.INVALID``, its message naming the field, the
limit and the value; the front's other requests go on.

Cheap on purpose: no check here walks more than a request's stop lists, logit bias and resumed
outputs (bounded by the link; the outputs by max_tokens too, before their ids are looked at); the
prompt's ids are checked as they are unpacked (front_link.py), its hashes only counted.
"""

from __future__ import annotations

from pagedserve.engine_api import ModelInfo
from pagedserve.request_bounds import (
    RequestLimits,
    ValidationError,
    check_beam_logprobs,
    check_count,
    check_int_range,
    check_logit_bias,
    check_max_tokens,
    check_n_or_beams,
    check_penalty,
    check_prompt_len,
    check_stop_strings,
    check_stop_token_ids,
    check_token_ids,
)
from pagedserve.wire import JSON_OBJECT_SCHEMA, MAX_INT32
from pagedserve.wire import front_messages as m


def check_submit(msg: m.Submit, prompt_len: int, limits: RequestLimits, info: ModelInfo | None) -> None:
    """ValidationError for the first bound ``msg``'s request breaks (its prompt's ids aside: they are
    still packed). ``info``: what the core's executors serve (None: none connected, so only the
    limits are checked; the request then fails for want of an executor)."""
    p, sp = msg.request.params, msg.request.params.sampling
    vocab = info.vocab_size if info is not None else MAX_INT32 + 1  # (token ids are < 2^31 on the link)
    check_count("sampling.n", p.n, limits.max_n)
    check_count("sampling.beam_width", p.beam_width, limits.max_beam_width)
    check_n_or_beams(p.n, p.beam_width)
    check_beam_logprobs(p.beam_width, sp.want_logprobs)
    check_penalty("sampling.presence_penalty", sp.presence_penalty)
    check_penalty("sampling.frequency_penalty", sp.frequency_penalty)
    check_stop_strings(p.stop, limits)
    check_stop_token_ids(p.stop_token_ids, vocab, limits)
    check_logit_bias(sp.logit_bias, vocab, limits)
    check_int_range("sampling.logprobs", sp.logprobs, 0, limits.max_logprobs)
    if sp.prompt_logprobs >= 0:
        check_int_range("sampling.prompt_logprobs", sp.prompt_logprobs, 0, limits.max_logprobs)
    check_int_range("sampling.min_tokens", sp.min_tokens, 0, p.max_tokens)
    if sp.beam_candidates:  # (the scheduler's, for beam search: an executor would report candidates, not sample)
        raise ValidationError("sampling.beam_candidates",
                              f"is the scheduler's to set; must be 0 (got {sp.beam_candidates})")
    if sp.structured is not None:
        _check_structured(sp.structured.spec, p.beam_width, limits)
    if prompt_len == 0:
        raise ValidationError("prompt_token_ids", "must not be empty")
    if msg.resume_outputs is not None:
        _check_resume(msg)
    if info is not None:
        _check_model(msg, prompt_len, info)


def _check_structured(spec: str, beam_width: int, limits: RequestLimits) -> None:
    if beam_width > 1:
        raise ValidationError("sampling.structured", f"cannot be combined with beam search (beam_width={beam_width})")
    if len(spec) > limits.max_structured_chars and spec != JSON_OBJECT_SCHEMA:
        raise ValidationError("sampling.structured", f"must be at most {limits.max_structured_chars} characters "
                                                     f"(got {len(spec)})")


def _check_model(msg: m.Submit, prompt_len: int, info: ModelInfo) -> None:
    req, vocab = msg.request, info.vocab_size
    check_prompt_len("prompt_token_ids", prompt_len, info.max_model_len)
    if msg.resume_outputs is None:  # (a moved request runs to the length fixed where it runs, as a migration does)
        check_max_tokens(req.params.max_tokens, prompt_len, info.max_model_len)
    check_token_ids("sampling.end_token_ids", req.params.sampling.end_token_ids, vocab)
    hashes = req.prompt_block_hashes
    if hashes is not None and len(hashes) != (full := prompt_len // info.block_size):
        raise ValidationError("prompt_block_hashes", f"must hold one hash per full block of the prompt: {full} for "
                                                     f"{prompt_len} tokens in blocks of {info.block_size} "
                                                     f"(got {len(hashes)})")
    for k, outputs in enumerate(msg.resume_outputs or ()):
        check_token_ids(f"resume_outputs[{k}]", outputs, vocab)


def _check_resume(msg: m.Submit) -> None:
    """A moved request's outputs: one per choice (or beam), none longer than max_tokens (one still
    running, shorter: at max_tokens it would have ended), and a finish reason for no more."""
    p, outputs, finished = msg.request.params, msg.resume_outputs or [], msg.resume_finished
    width = max(p.n, p.beam_width)
    if len(outputs) != width:
        raise ValidationError("resume_outputs", f"must hold one output per choice: {width} (got {len(outputs)})")
    if len(finished) > width:
        raise ValidationError("resume_finished", f"must hold at most one finish reason per choice: {width} "
                                                 f"(got {len(finished)})")
    for k, out in enumerate(outputs):
        done = k < len(finished) and finished[k] is not None
        if len(out) > p.max_tokens:
            raise ValidationError(f"resume_outputs[{k}]", f"must hold at most max_tokens={p.max_tokens} tokens "
                                                          f"(got {len(out)})")
        if len(out) == p.max_tokens and not done:
            raise ValidationError(f"resume_outputs[{k}]", f"a choice still running must hold fewer than "
                                                          f"max_tokens={p.max_tokens} tokens (got {len(out)})")
