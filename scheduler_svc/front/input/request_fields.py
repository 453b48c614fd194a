"""A request as a front read it, before any check: :class:`RequestFields`, the validator's input.

Both public fronts fill it: the gRPC front from its protobuf ``GenerateRequest``
(:func:`fields_from_proto`, where proto3 presence tells an unset optional from a zero), the HTTP
front from its JSON body (http/openai_fields.py). validation.py checks it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.front.input.structured import StructuredFields

# The sampling fields that are optional in the API: None (unset) takes the documented default.
OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "length_penalty", "logprobs",
                     "repetition_penalty", "presence_penalty", "frequency_penalty")


@dataclass(slots=True)
class RequestFields:
    """A request as a front read it, before any check; field meanings as in generation.proto.

    None means unset; 0 for ``max_tokens``, ``n`` and ``beam_width`` means the default.
    """

    request_id: str = ""
    prompt: str | None = None
    prompt_token_ids: Sequence[int] = ()
    max_tokens: int = 0
    n: int = 0
    beam_width: int = 0
    early_stopping: bool = False
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    ignore_eos: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    length_penalty: float | None = None
    logprobs: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: Sequence[tuple[int, float]] = ()  # (token id, bias)
    min_tokens: int = 0
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = None
    structured: StructuredFields | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks shared only among requests of one salt
    truncate_prompt_tokens: int | None = None  # vLLM's: keep the prompt's last k tokens (-1: no cut)


def fields_from_proto(req: pb.GenerateRequest) -> RequestFields:
    """The gRPC front's reading: proto3 presence (HasField) becomes None for unset optionals."""
    sp = req.sampling
    return RequestFields(
        request_id=req.request_id, prompt=req.prompt if req.HasField("prompt") else None,
        prompt_token_ids=req.prompt_token_ids, max_tokens=sp.max_tokens, n=sp.n, beam_width=sp.beam_width,
        early_stopping=sp.early_stopping, stop=sp.stop, stop_token_ids=sp.stop_token_ids,
        ignore_eos=sp.ignore_eos, logit_bias=sorted(sp.logit_bias.items()), min_tokens=sp.min_tokens,
        include_stop_str_in_output=sp.include_stop_str_in_output,
        prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None,
        structured=_structured_from_proto(sp.structured_outputs) if sp.HasField("structured_outputs") else None,
        cache_salt=req.cache_salt if req.HasField("cache_salt") else None,
        **{name: getattr(sp, name) if sp.HasField(name) else None for name in OPTIONAL_SAMPLING})


def _structured_from_proto(so: pb.StructuredOutputs) -> StructuredFields:
    f = StructuredFields()
    which = so.WhichOneof("kind")
    if which == "json_schema":
        f.json_schema = so.json_schema
    elif which == "json_object":
        f.json_object = so.json_object
    elif which == "regex":
        f.regex = so.regex
    elif which == "choice":
        f.choice = list(so.choice.values)
    elif which == "grammar":
        f.grammar = so.grammar
    return f
