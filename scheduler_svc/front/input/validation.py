"""Validation at the API edge: a client's request becomes a GenerationRequest.

Both public fronts share it ("one validator, two fronts"): the gRPC servicer reads a
protobuf ``GenerateRequest`` into :class:`RequestFields` (request_fields.py), the
OpenAI-compatible HTTP front reads its JSON body into the same type, and
:func:`validate_request` checks every field and applies the limits (server_limits.py).
Every check raises :class:`ValidationError` (a ValueError) whose message names the field,
the limit and the value given; field names are the gRPC API's (``sampling.temperature``),
which the HTTP front renames to its own. Nothing here touches the engine, so it is pure and
runs in a worker thread when a prompt is long enough for tokenization to matter.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Sequence

from pagedserve.engine_api import GenerationRequest, ModelInfo, RequestParams
from pagedserve.kv_blocks import MAX_CACHE_SALT_CHARS, request_blocks
from pagedserve.request_bounds import (
    CONTEXT_LENGTH_EXCEEDED,
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
    context_exceeded,
)
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.wire import GREEDY_TEMPERATURE_EPS, MAX_SEED, SamplingParams
from pagedserve.wire.protocol import MAX_END_TOKEN_IDS, MAX_INT32, MAX_LENGTH_PENALTY
from scheduler_svc.front.input.request_fields import RequestFields, fields_from_proto
from scheduler_svc.front.input.server_limits import ServerLimits, raw_list_problem
from scheduler_svc.front.input.structured import StructuredError, needs_check, structured_spec

LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")  # vLLM's --logprobs-mode values (raw: the default)


def validation_work(f: RequestFields) -> int:
    """How much validating ``f`` costs, in characters: its text prompt, or past the threshold of
    ``offload.validate_off_loop`` when a grammar engine must check its structured spec."""
    prompt = len(f.prompt) if f.prompt is not None else 0
    return prompt + (1 << 30 if needs_check(f.structured) else 0)


def validate_generate_request(
    req: pb.GenerateRequest,
    model: ModelInfo,
    limits: ServerLimits,
    tokenize: Callable[[str], list[int]],
    logprobs_mode: str = LOGPROBS_MODES[0],
) -> GenerationRequest:
    """The gRPC front: :func:`validate_request` of the protobuf request's fields."""
    return validate_request(fields_from_proto(req), model, limits, tokenize, logprobs_mode=logprobs_mode)


def validate_request(
    f: RequestFields,
    model: ModelInfo,
    limits: ServerLimits,
    tokenize: Callable[[str], list[int]],
    default_max_tokens: int | None = None,
    logprobs_mode: str = LOGPROBS_MODES[0],
) -> GenerationRequest:
    """Check every field of ``f`` and build the engine's request.

    ``tokenize`` turns a text prompt into token ids (special tokens included, or
    not for a chat template's output, which has them already).
    ``default_max_tokens`` replaces ``limits.default_max_tokens`` for a front whose
    API has another default (chat: the whole context left). ``logprobs_mode``: the
    deployment's ``--logprobs-mode``, which every executor then follows. ``arrival_time``
    and ``deadline`` are left for the caller to fill. A structured spec is checked by a
    grammar engine here: a front calls this in a worker thread when ``validation_work``
    says so.
    """
    request_id = _request_id(f.request_id, limits)
    prompt_ids = _prompt_token_ids(f, model, tokenize)
    default = limits.default_max_tokens if default_max_tokens is None else default_max_tokens
    n, beam_width = _n_and_beam_width(f, limits)
    max_tokens = _max_tokens(f.max_tokens, len(prompt_ids), model, default, max(n, beam_width))
    _check_blocks(len(prompt_ids), max_tokens, n, beam_width, model)
    stop_token_ids = _stop_token_ids(f.stop_token_ids, model, limits)
    sampling = _sampling(f, limits)
    _extensions(sampling, f, model, limits, max_tokens, beam_width, stop_token_ids)
    if logprobs_mode not in LOGPROBS_MODES:
        raise ValueError(f"logprobs_mode must be one of {LOGPROBS_MODES} (got {logprobs_mode!r})")
    sampling.processed_logprobs = logprobs_mode == "processed_logprobs"
    params = RequestParams(
        max_tokens=max_tokens,
        sampling=sampling,
        n=n,
        beam_width=beam_width,
        length_penalty=_length_penalty(f.length_penalty),
        early_stopping=f.early_stopping,
        stop=_stop_strings(f.stop, limits),
        stop_token_ids=stop_token_ids,
        ignore_eos=f.ignore_eos,
        include_stop_str_in_output=f.include_stop_str_in_output,
    )
    return GenerationRequest(request_id=request_id, prompt_token_ids=prompt_ids, params=params,
                             cache_salt=_cache_salt(f.cache_salt))


def _cache_salt(salt: str | None) -> str | None:
    if salt is not None and not 1 <= len(salt) <= MAX_CACHE_SALT_CHARS:
        raise ValidationError("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} "
                                            f"characters when given (got {len(salt)})")
    return salt


def _request_id(request_id: str, limits: ServerLimits) -> str:
    if not request_id:
        return uuid.uuid4().hex
    if len(request_id) > limits.max_request_id_len:
        raise ValidationError(
            "request_id", f"must be at most {limits.max_request_id_len} characters (got {len(request_id)})"
        )
    if not request_id.isprintable():
        raise ValidationError("request_id", f"must be printable (got {request_id!r})")
    return request_id


def _prompt_token_ids(f: RequestFields, model: ModelInfo, tokenize: Callable[[str], list[int]]) -> list[int]:
    has_text, has_ids = f.prompt is not None, len(f.prompt_token_ids) > 0
    if has_text == has_ids:
        got = "both" if has_text else "neither"
        raise ValidationError("prompt", f"exactly one of prompt and prompt_token_ids must be set (got {got})")
    if has_text:
        if not f.prompt:
            raise ValidationError("prompt", "must not be empty (got '')")
        _check_prompt_chars(len(f.prompt), model)  # before tokenizing: a huge prompt costs nothing
        ids = list(tokenize(f.prompt))
        if not ids:
            raise ValidationError("prompt", f"tokenizes to 0 tokens (got {f.prompt[:40]!r})")
        field = "prompt"
    else:
        given = _truncated(f.prompt_token_ids, f.truncate_prompt_tokens, model)  # (cut first, as vLLM does)
        if len(given) >= model.max_model_len:  # before copying or checking a long list
            raise ValidationError("prompt_token_ids", context_exceeded(model.max_model_len, len(given)),
                                  CONTEXT_LENGTH_EXCEEDED)
        ids = list(given)
        field = "prompt_token_ids"
    check_token_ids(field, ids, model.vocab_size)
    if has_text:
        ids = _truncated(ids, f.truncate_prompt_tokens, model)
    check_prompt_len(field, len(ids), model.max_model_len)
    return ids


def _truncated(ids: Sequence[int], keep: int | None, model: ModelInfo) -> Sequence[int]:
    """vLLM's ``truncate_prompt_tokens``: the prompt's last ``keep`` tokens (before its length is
    checked); -1 (vLLM: "up to max_model_len") keeps them all, as what fits the context is all
    a prompt may hold anyway. A text prompt is still bounded by its characters before it is
    tokenized (the context's worth of the longest tokens)."""
    if keep is None or keep == -1:
        return ids
    if not 1 <= keep <= model.max_model_len:
        raise ValidationError("truncate_prompt_tokens", f"must be -1 or in [1, max_model_len={model.max_model_len}] "
                                                        f"(got {keep})")
    return ids[-keep:]


def _check_prompt_chars(chars: int, model: ModelInfo) -> None:
    """A token spans at most ``model.max_token_chars`` characters, so a longer prompt than
    ``max_model_len`` such tokens is too large for any executor: rejected from its length, never tokenized."""
    if not model.max_token_chars:
        return
    bound = (model.max_model_len - 1) * model.max_token_chars
    if chars > bound:
        raise ValidationError("prompt", f"This model's maximum context length is {model.max_model_len} tokens. "
                                        f"However, the prompt has {chars} characters, more than any "
                                        f"{model.max_model_len - 1} tokens span (at most {bound}: the longest token "
                                        f"has {model.max_token_chars}). Please reduce the length of the prompt.",
                              CONTEXT_LENGTH_EXCEEDED)


def _max_tokens(max_tokens: int, prompt_len: int, model: ModelInfo, default: int, width: int) -> int:
    room = model.max_model_len - prompt_len  # >= 1, checked with the prompt
    if max_tokens == 0:  # the default never asks for more than the roomiest pool holds at once
        if model.max_request_blocks:
            room = min(room, model.max_request_blocks // width * model.block_size - prompt_len)
        return max(1, min(default, room))  # (below 1 the prompt alone does not fit: rejected next)
    if max_tokens < 1:
        raise ValidationError("sampling.max_tokens", f"must be >= 1, or 0 for the default (got {max_tokens})")
    check_max_tokens(max_tokens, prompt_len, model.max_model_len)
    return max_tokens


def _n_and_beam_width(f: RequestFields, limits: ServerLimits) -> tuple[int, int]:
    n = _count("sampling.n", f.n, limits.max_n)
    beam_width = _count("sampling.beam_width", f.beam_width, limits.max_beam_width)
    check_n_or_beams(n, beam_width)
    return n, beam_width


def _count(field: str, value: int, hi: int) -> int:
    """n or beam_width: 0 is unset (1). The range told past ``hi`` is [1, hi]: the HTTP front refuses
    0, and "[0, hi]" read as if 0 choices could be asked for."""
    if value < 0:
        raise ValidationError(field, f"must be >= 1, or 0 for the default of 1 (got {value})")
    value = int(value) or 1
    check_count(field, value, hi)
    return value


def _check_blocks(prompt_len: int, max_tokens: int, n: int, beam_width: int, model: ModelInfo) -> None:
    """Every choice (or beam) at full length must fit some executor's KV pool at once."""
    if not model.max_request_blocks:
        return
    width = max(n, beam_width)
    longest = min(prompt_len + max_tokens, model.max_model_len)
    need = request_blocks(prompt_len, max_tokens, width, model.max_model_len, model.block_size)
    if need > model.max_request_blocks:
        field = "sampling.n" if n > 1 else "sampling.beam_width" if beam_width > 1 else "sampling.max_tokens"
        raise ValidationError(
            field, f"{width} sequence(s) of up to {longest} tokens need {need} KV blocks of {model.block_size} "
                   f"tokens at once; the largest executor pool holds {model.max_request_blocks} "
                   f"(lower max_tokens, n or beam_width)")


def _length_penalty(value: float | None) -> float:
    if value is None:
        return 1.0
    lp = _finite("sampling.length_penalty", value)
    if not -MAX_LENGTH_PENALTY <= lp <= MAX_LENGTH_PENALTY:
        raise ValidationError("sampling.length_penalty",
                              f"must be in [{-MAX_LENGTH_PENALTY:g}, {MAX_LENGTH_PENALTY:g}] (got {lp:g})")
    return lp


def _top_k(value: int) -> int:
    """vLLM's -1 and 0 both mean off (the wire's 0); at most the wire's int32 (JSON has no bound)."""
    if value == -1:
        return 0
    if not 0 <= value <= MAX_INT32:
        raise ValidationError("sampling.top_k", f"must be -1 or 0 (off) or in [1, {MAX_INT32}] (got {value})")
    return int(value)


def _sampling(f: RequestFields, limits: ServerLimits) -> SamplingParams:
    out = SamplingParams()
    if f.temperature is not None:
        t = _finite("sampling.temperature", f.temperature)
        if t < 0:
            raise ValidationError("sampling.temperature", f"must be >= 0 (got {t:g})")
        out.temperature = 0.0 if t < GREEDY_TEMPERATURE_EPS else t
    if f.top_p is not None:
        if not 0.0 < f.top_p <= 1.0:  # also rejects NaN
            raise ValidationError("sampling.top_p", f"must be in (0, 1] (got {f.top_p:g})")
        out.top_p = float(f.top_p)
    if f.top_k is not None:
        out.top_k = _top_k(f.top_k)
    if f.min_p is not None:
        if not 0.0 <= f.min_p <= 1.0:
            raise ValidationError("sampling.min_p", f"must be in [0, 1] (got {f.min_p:g})")
        out.min_p = float(f.min_p)
    if f.seed is not None:
        out.seed = check_int_range("sampling.seed", f.seed, 0, MAX_SEED)
    if f.repetition_penalty is not None:
        rp = _finite("sampling.repetition_penalty", f.repetition_penalty)
        if rp <= 0:
            raise ValidationError("sampling.repetition_penalty", f"must be > 0 (got {rp:g})")
        out.repetition_penalty = rp
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(f, name)
        if value is not None:
            setattr(out, name, check_penalty(f"sampling.{name}", value))
    if f.logprobs is not None:
        out.want_logprobs = True
        out.logprobs = check_int_range("sampling.logprobs", f.logprobs, 0, limits.max_logprobs)
    return out


def _extensions(out: SamplingParams, f: RequestFields, model: ModelInfo, limits: ServerLimits, max_tokens: int,
                beam_width: int, stop_token_ids: list[int]) -> None:
    """logit_bias, min_tokens, prompt_logprobs and structured outputs into ``out``; the ids that end
    a sequence (EOS unless ignored, stop token ids) go along when min_tokens or a grammar needs them."""
    out.logit_bias = _logit_bias(f.logit_bias, model, limits)
    check_beam_logprobs(beam_width, out.want_logprobs)
    out.min_tokens = check_int_range("sampling.min_tokens", f.min_tokens, 0, max_tokens)
    if f.prompt_logprobs is not None:
        out.prompt_logprobs = check_int_range("sampling.prompt_logprobs", f.prompt_logprobs, 0, limits.max_logprobs)
    if f.structured is not None:
        field = f.structured.field
        if beam_width > 1:
            raise ValidationError(field, f"cannot be combined with beam search (beam_width={beam_width}): beams "
                                         "are chosen among candidates no grammar has masked")
        if f.ignore_eos:
            raise ValidationError(field, "cannot be combined with ignore_eos: a structured output ends with EOS "
                                         "once its grammar is complete")
        if not model.eos_token_ids:
            raise ValidationError(field, "needs an end-of-sequence token, and the model declares none")
        try:
            out.structured = structured_spec(f.structured, limits.max_structured_chars)
        except StructuredError as e:
            raise ValidationError(f"{field}.{e.field}" if e.field else field, e.detail) from None
    if out.min_tokens or out.structured is not None:
        ends = ([] if f.ignore_eos else list(model.eos_token_ids)) + stop_token_ids
        out.end_token_ids = list(dict.fromkeys(ends))[:MAX_END_TOKEN_IDS]


def _logit_bias(bias: Sequence[tuple[int, float]], model: ModelInfo, limits: ServerLimits) -> list[tuple[int, float]]:
    check_logit_bias(bias, model.vocab_size, limits)
    return [(int(tok), float(value)) for tok, value in bias]


def _stop_strings(stop: Sequence[str], limits: ServerLimits) -> list[str]:
    if (problem := raw_list_problem(len(stop), limits.max_stop_strings)) is not None:
        raise ValidationError("sampling.stop", problem)
    check_stop_strings(stop, limits)
    return list(dict.fromkeys(stop))  # duplicates change nothing, so they do not count


def _stop_token_ids(ids: Sequence[int], model: ModelInfo, limits: ServerLimits) -> list[int]:
    if (problem := raw_list_problem(len(ids), limits.max_stop_token_ids)) is not None:
        raise ValidationError("sampling.stop_token_ids", problem)
    check_stop_token_ids(ids, model.vocab_size, limits)
    return list(dict.fromkeys(ids))


def _finite(field: str, value: float) -> float:
    if not math.isfinite(value):
        raise ValidationError(field, f"must be finite (got {value:g})")
    return float(value)
