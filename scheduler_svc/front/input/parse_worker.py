"""The parse worker: a process that decodes a front's large requests and checks their counts, so
the front's event loop never does either (parse_pool.py starts it and talks to it).

msgspec and protobuf hold the GIL for a whole decode, so a thread of the front would stall its
loop just as long (a 43 ms decode in ``asyncio.to_thread`` stopped the loop for 47 ms). Here the
decode runs in another process; a request over one of the caps of guards/request_caps.py is
refused here, and one within them comes back as msgpack (HTTP), which the front rebuilds in a few
milliseconds at most, or as a verdict (gRPC: the front then parses the message itself, its items
being few now).

Frames on stdin and stdout, each a 4-byte little-endian length then msgpack. A request is the
frame ``[kind, caps, body length]`` (kind: "generate" or a name of ``KINDS``; caps:
RequestCaps.to_wire()) followed by the body's raw bytes (the front writes them in slices, never
copying the whole); a reply is ``[OK, packed]``, ``[REFUSED, error]`` (request_caps.error_to_wire)
or ``[FAILED, why]`` (a bug here: the front then decodes the body itself). The worker exits when
its stdin closes, i.e. with its front.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct
import sys
from typing import Any, BinaryIO

import msgspec

from pagedserve.v1 import generation_pb2 as pb
from scheduler_svc.front.api_errors import ApiError
from scheduler_svc.front.guards.request_caps import RequestCaps, check_generate, check_openai, error_to_wire
from scheduler_svc.front.http.openai_types import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    decode,
)
from scheduler_svc.front.http.responses_api_types import ResponsesRequest

OK, REFUSED, FAILED = 0, 1, 2
KINDS: dict[str, type[msgspec.Struct]] = {"completion": CompletionRequest, "chat": ChatRequest,
                                          "tokenize": TokenizeRequest, "detokenize": DetokenizeRequest,
                                          "responses": ResponsesRequest}
HEADER = struct.Struct("<I")
WORKER_NICENESS = 10


def handle(kind: str, caps: RequestCaps, body: bytes) -> list[Any]:
    """One request's reply (see the module docstring)."""
    try:
        if kind == "generate":
            return _generate(caps, body)
        req = decode(body, KINDS[kind])
        check_openai(req, caps)
        return [OK, msgspec.msgpack.encode(req)]
    except ApiError as e:
        return [REFUSED, error_to_wire(e)]


def _generate(caps: RequestCaps, body: bytes) -> list[Any]:
    try:
        req = pb.GenerateRequest.FromString(body)
    except Exception:
        return [REFUSED, [400, "the request is not a valid message", None, None]]
    problem = check_generate(req, caps)
    return [OK, b""] if problem is None else [REFUSED, [400, problem, None, None]]


def serve(inp: BinaryIO, out: BinaryIO) -> None:
    trim = _malloc_trim()
    encode = msgspec.msgpack.Encoder().encode
    decode_frame = msgspec.msgpack.Decoder().decode
    while True:
        head = inp.read(HEADER.size)
        if len(head) < HEADER.size:
            return  # the front is gone
        (size,) = HEADER.unpack(head)
        kind, caps, body_size = decode_frame(inp.read(size))
        body = inp.read(body_size)
        try:
            reply = handle(kind, RequestCaps.from_wire(caps), body)
        except Exception as e:  # a bug here must not take the worker down with it
            reply = [FAILED, f"{type(e).__name__}: {e}"[:500]]
        del body
        frame = encode(reply)
        out.write(HEADER.pack(len(frame)) + frame)
        out.flush()
        if trim is not None:
            trim(0)  # a large request's garbage back to the OS: the worker idles between floods


def _malloc_trim():
    name = ctypes.util.find_library("c")
    return getattr(ctypes.CDLL(name), "malloc_trim", None) if name else None


def main() -> None:
    # Behind everything else on the machine: a flood of large requests keeps this process busy, and
    # the front, the engine and the executors serving benign requests must get the CPU first.
    os.nice(WORKER_NICENESS)
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # a stray print, ours or a library's, must never corrupt a frame
    try:
        serve(sys.stdin.buffer, out)
    except KeyboardInterrupt:  # the front's process group was interrupted
        pass


if __name__ == "__main__":
    main()
