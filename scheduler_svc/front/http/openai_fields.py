"""OpenAI request bodies (openai_types.py) into the shared validator's :class:`RequestFields`.

What this front adds on top of the gRPC API's fields is checked here (prompt shapes, which
structured-output field was used, the fields that would change the output and are not
implemented, vLLM's rules between fields); everything else is left to
``scheduler_svc.front.input.validation``, so both fronts apply one set of rules. Errors are 400s
naming the OpenAI field.
"""

from __future__ import annotations

import math
import re
from typing import Any

from pagedserve.request_bounds import LOGIT_BIAS_RANGE
from pagedserve.wire import MAX_SEED
from scheduler_svc.front.api_errors import bad_field
from scheduler_svc.front.http.limits import HttpLimits
from scheduler_svc.front.http.openai_types import ChatRequest, CompletionRequest, TokenizeRequest, _Request
from scheduler_svc.front.input.request_fields import RequestFields
from scheduler_svc.front.input.structured import StructuredFields


def completion_fields(req: CompletionRequest, limits: HttpLimits) -> list[RequestFields]:
    """One RequestFields per prompt of the request (a list of prompts is a batch). ``echo`` with
    ``logprobs`` asks for the prompt's log-probs too (computed while it is prefilled); ``echo`` with
    ``max_tokens`` 0 scores the prompt alone (:func:`echo_only`): one token is generated, and dropped."""
    if req.suffix:
        raise bad_field("suffix", "is not supported", code="unsupported")
    common = _common(req, 1 if echo_only(req) else req.max_tokens, "max_tokens")
    common["logprobs"] = req.logprobs
    if req.echo and req.logprobs is not None and req.prompt_logprobs is None:
        common["prompt_logprobs"] = req.logprobs
    return [RequestFields(prompt=p, **common) if isinstance(p, str) else RequestFields(prompt_token_ids=p, **common)
            for p in prompts(req.prompt, limits)]


def echo_only(req: CompletionRequest) -> bool:
    """``echo`` with ``max_tokens`` 0: the answer is the prompt (and its log-probs) alone, nothing
    generated, as OpenAI and vLLM answer it (lm-eval-harness scores prompts so)."""
    return bool(req.echo) and req.max_tokens == 0


def chat_fields(req: ChatRequest) -> RequestFields:
    """The fields of a chat request; its prompt (the rendered messages) is set by the caller, and so
    is the grammar of ``tool_choice`` required or named (``tool_calls.plan_tools``)."""
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_field("top_logprobs", "requires logprobs to be true")
    check_final_message(req)
    if req.logprobs and req.use_beam_search and (req.n or 1) > 1:  # (named here: chat's `logprobs`, a bool)
        raise bad_field("logprobs", f"cannot be combined with beam search (use_beam_search with n={req.n}): beams "
                                    "report no per-token log-probs")
    if req.max_completion_tokens is not None:
        common = _common(req, req.max_completion_tokens, "max_completion_tokens")
    else:
        common = _common(req, req.max_tokens, "max_tokens")
    common["logprobs"] = (req.top_logprobs or 0) if req.logprobs else None
    return RequestFields(**common)


def check_final_message(req: ChatRequest | TokenizeRequest) -> None:
    """vLLM's rule: the last message is either continued or followed by the assistant's turn."""
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_field("continue_final_message", "cannot be combined with add_generation_prompt=true (its "
                                                  "default): set add_generation_prompt to false")


def _common(req: _Request, max_tokens: int | None, max_tokens_name: str) -> dict[str, Any]:
    _reject_unsupported(req)
    if req.stream_options is not None and not req.stream:
        raise bad_field("stream_options", "is only allowed with stream=true")
    n = _at_least_one("n", req.n)
    fields: dict[str, Any] = dict(
        max_tokens=_at_least_one(max_tokens_name, max_tokens) or 0,  # 0: the validator's default
        n=n or 0, stop=[req.stop] if isinstance(req.stop, str) else req.stop or [],
        stop_token_ids=req.stop_token_ids or [], ignore_eos=req.ignore_eos, early_stopping=req.early_stopping,
        temperature=req.temperature, top_p=req.top_p, top_k=None if req.top_k in (-1, 0) else req.top_k,
        min_p=req.min_p, seed=_seed(req.seed), length_penalty=req.length_penalty,
        repetition_penalty=req.repetition_penalty, presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty, logit_bias=_logit_bias(req.logit_bias), min_tokens=req.min_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output, prompt_logprobs=req.prompt_logprobs,
        structured=structured_fields(req), cache_salt=req.cache_salt, truncate_prompt_tokens=req.truncate_prompt_tokens)
    if req.use_beam_search:  # vLLM: n beams, returned best first; width 1 is greedy
        fields["n"], fields["beam_width"] = 0, (n or 1)
        if (n or 1) == 1:
            fields["temperature"] = 0.0
    return fields


# vLLM's fields whose effect on the output is not implemented: set (truthy), they are a 400, not ignored.
_UNSUPPORTED = ("allowed_token_ids", "bad_words", "return_tokens_as_token_ids", "guided_whitespace_pattern",
                "logits_processors", "vllm_xargs")
_UNSUPPORTED_IN_CHAT = ("echo", "chat_template")


def _reject_unsupported(req: _Request) -> None:
    for name in _UNSUPPORTED + (_UNSUPPORTED_IN_CHAT if isinstance(req, ChatRequest) else ()):
        if getattr(req, name):
            raise bad_field(name, "is not supported by this server", code="unsupported")
    if req.priority:
        raise bad_field("priority", f"must be 0: this server has no priority scheduling (got {req.priority})",
                        code="unsupported")
    if req.best_of is not None and req.best_of != (req.n or 1):
        raise bad_field("best_of", f"must equal n when given (got best_of={req.best_of}, n={req.n or 1})",
                        code="unsupported")


# A logit_bias key (JSON object keys are strings; OpenAI's are token ids): ASCII digits only, as
# str.isdigit() and int() would take "²" (int() fails: a 500), "٣" (token 3) or 5,000 digits (int() fails).
_TOKEN_ID_KEY = re.compile(r"[0-9]{1,19}")


def _logit_bias(bias: dict[str, float] | None) -> list[tuple[int, float]]:
    """Each bias clamped to OpenAI's [-100, 100], as vLLM clamps it (a client sending 1e9 to force
    a token gets +100, which does); NaN stays, for the shared check to refuse."""
    lo, hi = LOGIT_BIAS_RANGE
    out = []
    for key, value in (bias or {}).items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise bad_field("logit_bias", f"keys must be token ids, decimal integers of at most 19 digits "
                                          f"(got {key[:40]!r})")
        out.append((int(key), value if math.isnan(value) else min(hi, max(lo, value))))
    return out


def structured_fields(req: _Request) -> StructuredFields | None:
    """The one structured-output field a request used (a 400 when it used two)."""
    found: list[StructuredFields] = []
    rf = req.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_object":
            found.append(StructuredFields(field="response_format", json_object=True))
        elif rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema is None:
                raise bad_field("response_format.json_schema.schema", "is required with type 'json_schema'")
            found.append(StructuredFields(field="response_format", json_schema=rf.json_schema.schema))
        else:
            raise bad_field("response_format.type", f"must be 'text', 'json_object' or 'json_schema' "
                                                    f"(got {rf.type[:40]!r})", code="unsupported")
    so = req.structured_outputs
    if so is not None:
        if so.structural_tag is not None:
            raise bad_field("structured_outputs.structural_tag", "is not supported", code="unsupported")
        found.append(StructuredFields(field="structured_outputs", json_schema=so.json, regex=so.regex,
                                      choice=so.choice, grammar=so.grammar, json_object=bool(so.json_object)))
    for name, kw in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                     ("guided_grammar", "grammar")):
        value = getattr(req, name)
        if value is not None:
            found.append(StructuredFields(field=name, **{kw: value}))
    if len(found) > 1:
        raise bad_field(found[1].field, f"cannot be combined with {found[0].field}: one grammar per request")
    return found[0] if found else None


def _seed(seed: int | None) -> int | None:
    """vLLM takes any int64 seed (UIs send -1); a seed is 64 bits here (gRPC's is a uint64), so a
    negative one stands for its two's complement: -1 is the seed 2**64 - 1."""
    if seed is None:
        return None
    if not -(2**63) <= seed <= MAX_SEED:
        raise bad_field("seed", f"must be in [{-(2**63)}, {MAX_SEED}] (got {seed})")
    return seed & MAX_SEED


def _at_least_one(name: str, value: int | None) -> int | None:
    if value is not None and value < 1:
        raise bad_field(name, f"must be >= 1 (got {value})")
    return value


def prompts(prompt: str | list[str | int | list[int]] | None, limits: HttpLimits) -> list[str | list[int]]:
    """OpenAI's four prompt shapes -> a list of text or token-id prompts."""
    if prompt is None:
        raise bad_field("prompt", "is required", code="missing_required_parameter")
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise bad_field("prompt", "must not be an empty list")
    if all(_is_int(t) for t in prompt):
        return [prompt]  # one prompt of token ids
    if all(isinstance(p, str) for p in prompt):
        batch = prompt
    elif all(isinstance(p, list) for p in prompt):
        for i, p in enumerate(prompt):
            if not p or not all(_is_int(t) for t in p):
                raise bad_field(f"prompt[{i}]", "must be a non-empty list of token ids (integers)")
        batch = prompt
    else:
        raise bad_field("prompt", "must be a string, a list of strings, a list of token ids, "
                                  "or a list of lists of token ids")
    if len(batch) > limits.max_prompts:
        raise bad_field("prompt", f"at most {limits.max_prompts} prompts per request (got {len(batch)})")
    return batch


def is_batch(prompt: str | list[str | int | list[int]] | None) -> bool:
    """Whether ``prompt``, one :func:`prompts` took, is a list of prompts (of strings or of token-id
    lists), even of one. (Its first item tells: :func:`prompts` refused a list of mixed items, so a
    prompt of token ids, up to max_model_len of them, is not scanned again.)"""
    return isinstance(prompt, list) and bool(prompt) and not _is_int(prompt[0])


def _is_int(x: Any) -> bool:
    return type(x) is int  # JSON true/false decode to bool, a subclass of int
