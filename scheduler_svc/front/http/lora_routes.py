"""vLLM's runtime LoRA endpoints, served with ``--enable-lora --allow-runtime-lora-updating``
(vLLM: ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``), behind the API keys as every route is:

- ``POST /v1/load_lora_adapter`` ``{"lora_name": ..., "lora_path": ...}``: the PEFT directory, as
  every executor sees it, is checked as at start and served under the name from then on, on every
  engine core; 400 naming the problem (a bad adapter, a name already served or the served model's
  own, which requests could never reach), nothing changed.
- ``POST /v1/unload_lora_adapter`` ``{"lora_name": ...}``: new requests may no longer name it (404);
  running ones finish under it. 404 for a name not served.

Both answer 200 with a line of text, as vLLM does; the front that answers already lists the change
in ``/v1/models`` (the core sends every front its new model list before it answers).
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Protocol

import msgspec
from msgspec import Meta
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route

from pagedserve.lora_modules import MAX_NAME_CHARS, LoraConfigError, check_not_base_model
from pagedserve.wire.protocol import MAX_LORA_PATH_CHARS
from scheduler_svc.front.api_errors import ApiError

MAX_BODY_BYTES = 64 * 1024
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME_CHARS)]


class LoadLoraRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: Name
    lora_path: Annotated[str, Meta(min_length=1, max_length=MAX_LORA_PATH_CHARS)]


class UnloadLoraRequest(msgspec.Struct, forbid_unknown_fields=True):
    lora_name: Name
    lora_int_id: int | None = None  # (vLLM's; ignored: the name is the adapter)


class LoraFront(Protocol):
    engine: Any

    async def small_body(self, request: Request, kind: type, limit: int) -> Any: ...


def routes(front: LoraFront) -> list[Route]:
    return [Route("/v1/load_lora_adapter", functools.partial(load, front), methods=["POST"]),
            Route("/v1/unload_lora_adapter", functools.partial(unload, front), methods=["POST"])]


async def load(front: LoraFront, request: Request) -> Response:
    req = await front.small_body(request, LoadLoraRequest, MAX_BODY_BYTES)
    info = front.engine.model_info()  # (None: no executor yet, and update_lora refuses that itself)
    if info is not None:
        try:
            check_not_base_model(req.lora_name, info.model_name)
        except LoraConfigError as exc:
            raise ApiError(400, f"lora_name: {exc}", param="lora_name", code="invalid_lora_adapter") from None
    _check(await front.engine.update_lora(req.lora_name, req.lora_path), "lora_path")
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


async def unload(front: LoraFront, request: Request) -> Response:
    req = await front.small_body(request, UnloadLoraRequest, MAX_BODY_BYTES)
    _check(await front.engine.update_lora(req.lora_name, None), "lora_name")
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")


def _check(answer, param: str) -> None:
    if answer.error is not None:
        raise ApiError(404 if answer.not_found else 400, answer.error, param="lora_name" if answer.not_found else param,
                       code="lora_not_found" if answer.not_found else "invalid_lora_adapter")
