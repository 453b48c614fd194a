"""The frameworks' own cost per streamed message: the floor under a front's CPU per token.

A process that serves the two streaming calls ``benchmarks/tier_load.py`` makes, gRPC ``Generate``
and HTTP ``POST /v1/completions`` with server-sent events, on the same frameworks as the fronts
(grpc.aio; uvicorn with httptools; both on uvloop), with none of pagedserve's code: every
``--step-ms`` one tick wakes every open stream, which writes one token's message (a protobuf
``GenerateResponse``; a ``data:`` event encoded by msgspec, the fronts' own JSON encoder, as the
cheapest there is: the stdlib's ``json.dumps`` costs ~5 µs more per event here) until it has sent
the tokens asked for.
No validation, tokenization, detokenization, mailbox or engine link: what a front could not spend
less than per message with these frameworks on this machine, measured by ``tier_capacity`` in the
same run as the fronts, with the same clients.

    python -m benchmarks.front_floor --step-ms 30

Prints one JSON line, ``{"grpc": PORT, "http": PORT}``, once both listen; serves until stdin closes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys

import grpc
import msgspec
import uvicorn
import uvloop

from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

TOKEN_ID, TOKEN_TEXT = 7, " word"  # every message carries one token
_encode = msgspec.json.Encoder().encode


class Ticker:
    """Wakes every waiting stream once per step, as the engine core's ``Updates`` wake a front's."""

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.waiting: list[asyncio.Future] = []

    async def next_token(self) -> None:
        fut = asyncio.get_running_loop().create_future()
        self.waiting.append(fut)
        await fut

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.step_s)
            waiting, self.waiting = self.waiting, []
            for fut in waiting:
                if not fut.done():
                    fut.set_result(None)


class FloorServicer(pb_grpc.GenerationServicer):
    def __init__(self, ticker: Ticker) -> None:
        self.ticker = ticker

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        n = request.sampling.max_tokens
        for i in range(n):
            await self.ticker.next_token()
            last = i == n - 1
            choice = pb.Choice(index=0, text=TOKEN_TEXT, token_ids=[TOKEN_ID],
                               finish_reason=pb.FINISH_REASON_LENGTH if last else pb.FINISH_REASON_UNSPECIFIED)
            usage = pb.Usage(prompt_tokens=len(request.prompt_token_ids), completion_tokens=n) if last else None
            await context.write(pb.GenerateResponse(request_id=request.request_id, choices=[choice], usage=usage))


def completions_app(ticker: Ticker):
    """A bare ASGI app: ``POST /v1/completions`` streams ``max_tokens`` events, one per tick."""

    async def app(scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        body = b""
        while True:
            event = await receive()
            body += event.get("body", b"")
            if not event.get("more_body"):
                break
        n = int(json.loads(body)["max_tokens"])
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]})
        for i in range(n):
            await ticker.next_token()
            chunk = {"id": "cmpl-floor", "object": "text_completion", "model": "floor",
                     "choices": [{"index": 0, "text": TOKEN_TEXT, "token_ids": [TOKEN_ID], "logprobs": None,
                                  "finish_reason": "length" if i == n - 1 else None}]}
            await send({"type": "http.response.body", "body": b"data: " + _encode(chunk) + b"\n\n",
                        "more_body": True})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    return app


async def serve(step_s: float) -> None:
    ticker = Ticker(step_s)
    tick = asyncio.create_task(ticker.run())
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(FloorServicer(ticker), server)
    grpc_port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    config = uvicorn.Config(completions_app(ticker), host="127.0.0.1", port=0, loop="none", http="httptools",
                            lifespan="off", access_log=False, log_config=None, server_header=False)
    http = uvicorn.Server(config)
    http_task = asyncio.create_task(http.serve())
    while not http.started:
        await asyncio.sleep(0.01)
    http_port = http.servers[0].sockets[0].getsockname()[1]
    print(json.dumps({"grpc": grpc_port, "http": http_port}), flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # until the benchmark closes stdin
    http.should_exit = True
    await http_task
    await server.stop(0)
    tick.cancel()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--step-ms", type=float, default=30.0, help="time between ticks (the modelled step)")
    a = ap.parse_args(argv)
    uvloop.run(serve(a.step_ms / 1e3))


if __name__ == "__main__":
    main()
