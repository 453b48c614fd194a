"""vLLM's utility endpoints on the HTTP port: /tokenize, /detokenize, /version.

- ``POST /tokenize``: ``{"prompt": text, "add_special_tokens": true}`` or ``{"messages": [...],
  "add_generation_prompt": true, "continue_final_message": false, "chat_template_kwargs": {}}``
  (rendered with the chat template, as a chat request is) -> ``{"count", "max_model_len",
  "tokens"}``, and ``"token_strs"`` (each id's vocabulary entry) with ``"return_token_strs": true``;
  a text longer than any prompt could be is rejected before it is tokenized, and a long one is
  tokenized off the event loop, as a request's prompt is.
- ``POST /detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}``, special tokens included (as
  vLLM's); ids outside the vocabulary and more ids than max_model_len are a 400.
- ``GET /version``: ``{"version"}``.

(``/metrics`` on this port is app.py's: the deployment's metrics, whichever front answers.)

Bodies are bounded as every request's are (``--http-max-body-bytes``).
"""

from __future__ import annotations

import functools
from typing import Any, Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from pagedserve import __version__
from scheduler_svc.front.api_errors import ApiError, bad_field
from scheduler_svc.front.http.chat_messages import chat_messages
from scheduler_svc.front.http.chat_template import ChatTemplateError, template_error
from scheduler_svc.front.http.openai_fields import check_final_message
from scheduler_svc.front.http.openai_types import ChatRequest, DetokenizeRequest, TokenizeRequest
from scheduler_svc.front.input.offload import token_ids, validate_off_loop


class OpenAIFront(Protocol):
    """What these endpoints use of app.py's front (the model, its tokenizer and template, the bounded read)."""

    tokenizer: Any
    chat_template: Any
    http_limits: Any

    async def _admit(self, request: Request, kind: type) -> tuple[float, bytes, Any, Any, str | None]: ...


def routes(front: OpenAIFront) -> list[Route]:
    return [
        Route("/tokenize", functools.partial(tokenize, front), methods=["POST"]),
        Route("/detokenize", functools.partial(detokenize, front), methods=["POST"]),
        Route("/version", version, methods=["GET"]),
    ]


async def version(request: Request) -> Response:
    return _json({"version": __version__})


async def tokenize(front: OpenAIFront, request: Request) -> Response:
    _, body, req, info, _lora = await front._admit(request, TokenizeRequest)  # (an adapter shares the tokenizer)
    if (req.prompt is None) == (req.messages is None):
        raise bad_field("prompt", "exactly one of prompt and messages must be given")
    if req.prompt is not None:
        bound = (info.max_model_len - 1) * max(info.max_token_chars, 1)
        if info.max_token_chars and len(req.prompt) > bound:
            raise bad_field("prompt", f"has {len(req.prompt)} characters; no prompt longer than {bound} can fit")
        ids = await validate_off_loop(len(req.prompt), token_ids, front.tokenizer, req.prompt,
                                      req.add_special_tokens is not False)
    else:  # the template renders off the loop too, by the body's size, as a chat request's does (app.py)
        special = req.add_special_tokens is True
        ids = await validate_off_loop(len(body), lambda: token_ids(front.tokenizer, _render(front, req), special))
    out = {"count": len(ids), "max_model_len": info.max_model_len, "tokens": ids}
    if req.return_token_strs:
        out["token_strs"] = [front.tokenizer.id_to_token(i) for i in ids]
    return _json(out)


def _render(front: OpenAIFront, req: TokenizeRequest) -> str:
    if front.chat_template is None:
        raise ApiError(400, "the model has no chat template", param="messages", code="no_chat_template")
    check_final_message(req)
    messages = chat_messages(ChatRequest(messages=req.messages), front.http_limits)
    try:
        return front.chat_template.render(messages, req.add_generation_prompt,
                                          continue_final_message=bool(req.continue_final_message),
                                          template_kwargs=req.chat_template_kwargs)
    except ChatTemplateError as e:
        raise template_error(e) from e


async def detokenize(front: OpenAIFront, request: Request) -> Response:
    _, body, req, info, _lora = await front._admit(request, DetokenizeRequest)
    if len(req.tokens) > info.max_model_len:
        raise bad_field("tokens", f"at most max_model_len={info.max_model_len} ids (got {len(req.tokens)})")
    for i, tok in enumerate(req.tokens):
        if not 0 <= tok < info.vocab_size:
            raise bad_field(f"tokens[{i}]", f"must be a token id in [0, vocab_size={info.vocab_size}) (got {tok})")
    # Special tokens kept (tokenizers' decode drops them by default), as vLLM's decode does: the text
    # of a chat prompt's or a BOS-led prompt's ids then tokenizes back to the same ids.
    text = await validate_off_loop(len(req.tokens), front.tokenizer.decode, req.tokens, False)
    return _json({"prompt": text})


def _json(body: Any) -> Response:
    return Response(msgspec.json.encode(body), media_type="application/json")

