"""The per-request limits, and the checks a front and an engine core both make with them.

A front validates a client's request against its :class:`RequestLimits` (the per-request part of
its ``ServerLimits``, scheduler_svc/front/input/server_limits.py) and the model's
:class:`ModelInfo`. An engine core holds each ``Submit`` it decodes to its own limits again
(scheduler_svc/engine/submit_bounds.py): a front is another process, perhaps another Deployment
with other flags, perhaps broken, and what it sends must not reach an executor unbounded. The
checks both make are here, once, with one message: :class:`ValidationError` names the field (the
gRPC API's name, ``sampling.n``), the limit and the value given.

What the wire bounds for every deployment alike (``Meta`` on the link's types, pagedserve/engine_api.py)
is no limit here: a front's limit may not exceed it (:attr:`RequestLimits.WIRE_MAX`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from pagedserve.wire.protocol import (
    MAX_CHOICES,
    MAX_END_TOKEN_IDS,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STRUCTURED_CHARS,
    MAX_TOP_LOGPROBS,
)

LOGIT_BIAS_RANGE = (-100.0, 100.0)  # OpenAI's
PENALTY_RANGE = (-2.0, 2.0)  # OpenAI's presence and frequency penalties


INVALID_VALUE = "invalid_value"
# OpenAI's code for a request past the context; clients (LiteLLM, LangChain, agent loops) read it,
# or the sentence context_exceeded() starts with, to trim a conversation and retry.
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class ValidationError(ValueError):
    """A client error in one field of a request: ``field`` (the gRPC API's name), ``detail``, and
    the error ``code`` the HTTP front answers with."""

    def __init__(self, field: str, message: str, code: str = INVALID_VALUE) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.detail = message
        self.code = code


def context_exceeded(max_model_len: int, prompt_len: int, max_tokens: int | None = None) -> str:
    """Why a prompt (and the tokens asked for) does not fit, in the words OpenAI and vLLM use."""
    if max_tokens is None:
        return (f"This model's maximum context length is {max_model_len} tokens. However, the prompt has "
                f"{prompt_len} tokens, which leaves no room to generate: at most {max_model_len - 1} are allowed. "
                "Please reduce the length of the prompt.")
    return (f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the prompt, {max_tokens} in the completion): "
            f"at most {max(0, max_model_len - prompt_len)} can be generated after this prompt. "
            "Please reduce the length of the prompt or completion.")


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may ask for (each a flag of the scheduler and of a front: ``--max-n``, ...)."""

    # Limits that may be 0: that feature is then off (max_logprobs=0 still allows the sampled token's).
    ZERO_ALLOWED: ClassVar[frozenset[str]] = frozenset({"max_stop_strings", "max_stop_token_ids", "max_logprobs",
                                                        "max_logit_bias", "max_structured_chars"})
    # What the front link carries at most: a request past one would make a Submit the engine core
    # cannot decode (it drops the front, every request on it) or plans every executor refuses.
    # Beam search asks each beam for 2 x beam_width candidates (sched/lifecycle.py).
    WIRE_MAX: ClassVar[dict[str, int]] = {
        "max_n": MAX_CHOICES, "max_beam_width": MAX_TOP_LOGPROBS // 2, "max_stop_strings": MAX_STOP_STRINGS,
        "max_stop_string_len": MAX_STOP_STRING_CHARS, "max_stop_token_ids": MAX_END_TOKEN_IDS,
        "max_logprobs": MAX_TOP_LOGPROBS, "max_structured_chars": MAX_STRUCTURED_CHARS}

    max_n: int = 16
    max_beam_width: int = 8
    max_stop_strings: int = 16
    max_stop_string_len: int = 256  # characters
    max_stop_token_ids: int = 64
    max_logprobs: int = 20
    max_logit_bias: int = 1024  # entries of a request's logit_bias (0: not accepted)
    max_structured_chars: int = 65536  # characters of a JSON schema, regex or grammar (0: not accepted)

    def __post_init__(self) -> None:
        for name in (f.name for f in dataclasses.fields(self)):
            value = getattr(self, name)
            low = 0 if self.zero_allowed(name) else 1
            if not isinstance(value, int) or value < low:
                raise ValueError(f"{type(self).__name__}.{name} must be an integer >= {low} (got {value!r})")
            if (high := self.WIRE_MAX.get(name)) is not None and value > high:
                raise ValueError(f"{type(self).__name__}.{name} must be an integer in [{low}, {high}], what the "
                                 f"links carry (got {value!r})")

    @classmethod
    def zero_allowed(cls, name: str) -> bool:
        return name in cls.ZERO_ALLOWED


def check_token_ids(field: str, ids: Sequence[int], vocab_size: int, offset: int = 0, unsigned: bool = False) -> None:
    """ValidationError naming ``field[offset + i]`` of the first id outside [0, vocab_size). The bounds
    are taken at C speed (a loop over a 131K-token prompt held the event loop ~10 ms); only a bad id
    is looked for. ``unsigned``: none is negative (unpacked uint32s), so only the max is taken."""
    if not ids or ((unsigned or min(ids) >= 0) and max(ids) < vocab_size):
        return
    i, tok = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab_size)
    raise ValidationError(f"{field}[{offset + i}]", f"must be a token id in [0, vocab_size={vocab_size}) (got {tok})")


def check_prompt_len(field: str, n: int, max_model_len: int) -> None:
    if n >= max_model_len:
        raise ValidationError(field, context_exceeded(max_model_len, n), CONTEXT_LENGTH_EXCEEDED)


def check_max_tokens(max_tokens: int, prompt_len: int, max_model_len: int) -> None:
    """The prompt and every token asked for within the longest context (the prompt already fits)."""
    if max_tokens > max_model_len - prompt_len:
        # (the field's name is the error's own: the HTTP front names max_completion_tokens for it)
        raise ValidationError("sampling.max_tokens", context_exceeded(max_model_len, prompt_len, max_tokens),
                              CONTEXT_LENGTH_EXCEEDED)


def check_count(field: str, value: int, hi: int) -> None:
    """n or beam_width, once set: in [1, hi]."""
    if not 1 <= value <= hi:
        raise ValidationError(field, f"must be in [1, {hi}] (got {value})")


def check_n_or_beams(n: int, beam_width: int) -> None:
    if n > 1 and beam_width > 1:
        raise ValidationError("sampling.n", f"must be 0 or 1 with beam search (beam_width={beam_width} returns that "
                                            f"many beams as the choices); got n={n}")


def check_beam_logprobs(beam_width: int, want_logprobs: bool) -> None:
    """Refused, never dropped: beams report no per-token log-probs, so the answer would lack them."""
    if beam_width > 1 and want_logprobs:
        raise ValidationError("sampling.logprobs", f"cannot be combined with beam search (beam_width={beam_width}): "
                                                   "beams report no per-token log-probs")


def check_penalty(field: str, value: float) -> float:
    """A presence or frequency penalty (NaN fails the range too)."""
    lo, hi = PENALTY_RANGE
    if not lo <= value <= hi:
        raise ValidationError(field, f"must be in [{lo:g}, {hi:g}] (got {value:g})")
    return float(value)


def check_int_range(field: str, value: int, lo: int, hi: int | None) -> int:
    if value < lo or (hi is not None and value > hi):
        bound = f"in [{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise ValidationError(field, f"must be {bound} (got {value})")
    return int(value)


def check_stop_strings(stop: Sequence[str], limits: RequestLimits) -> None:
    """Each stop string 1 to max_stop_string_len characters, at most max_stop_strings distinct."""
    for i, s in enumerate(stop):
        if not s:
            raise ValidationError(f"sampling.stop[{i}]", "must not be empty (got '')")
        if len(s) > limits.max_stop_string_len:
            raise ValidationError(f"sampling.stop[{i}]",
                                  f"must be at most {limits.max_stop_string_len} characters (got {len(s)})")
    if (distinct := len(set(stop))) > limits.max_stop_strings:
        raise ValidationError("sampling.stop", f"at most {limits.max_stop_strings} distinct stop strings (got {distinct})")


def check_stop_token_ids(ids: Sequence[int], vocab_size: int, limits: RequestLimits) -> None:
    """Each stop token id in the vocabulary, at most max_stop_token_ids distinct."""
    check_token_ids("sampling.stop_token_ids", ids, vocab_size)
    if (distinct := len(set(ids))) > limits.max_stop_token_ids:
        raise ValidationError("sampling.stop_token_ids", f"at most {limits.max_stop_token_ids} distinct ids "
                                                         f"(got {distinct})")


def check_logit_bias(bias: Sequence[tuple[int, float]], vocab_size: int, limits: RequestLimits) -> None:
    """At most max_logit_bias entries (and what a plan carries), each naming a token id in the
    vocabulary, each bias in LOGIT_BIAS_RANGE (NaN is not)."""
    cap = min(limits.max_logit_bias, MAX_LOGIT_BIAS)
    if len(bias) > cap:
        raise ValidationError("sampling.logit_bias", f"at most {cap} entries (got {len(bias)})")
    lo, hi = LOGIT_BIAS_RANGE
    for tok, value in bias:
        if not 0 <= tok < vocab_size:
            raise ValidationError(f"sampling.logit_bias[{tok}]",
                                  f"must name a token id in [0, vocab_size={vocab_size}) (got {tok})")
        if not lo <= value <= hi:  # (also rejects NaN)
            raise ValidationError(f"sampling.logit_bias[{tok}]", f"must be in [{lo:g}, {hi:g}] (got {value:g})")
