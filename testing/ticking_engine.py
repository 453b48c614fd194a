"""A front's own CPU per streamed token, by ``--stream-interval``: a real front over an engine that ticks.

The real gRPC server (``start_grpc_server``: validation, ``Engine.generate``'s ``OutputStream``,
protobuf, grpc.aio writes), or with ``api="http"`` the real OpenAI-compatible server (uvicorn,
Starlette, one server-sent event per message, ``return_token_ids``), runs in this process on
uvloop; the engine is :class:`TickingEngine`, which every modelled step puts one token into each
running request's mailbox (a real ``Tracked``, which holds tokens for the stream interval as the
engine's does), as the engine's fan-out does. So what is measured is the front's own cost per
token. The clients (grpc.aio, one streaming ``Generate`` per request; or aiohttp, one streaming
``POST /v1/completions`` per request) run in a subprocess whose CPU is not counted.
``benchmarks/tier_capacity.py --phases intervals`` reports it; the tests check that every token
arrives, in the messages the interval makes.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time

import uvloop

from pagedserve.engine_api import (
    ChoiceDelta,
    FinishReason,
    GenerationRequest,
    ModelInfo,
    RequestOutput,
    Usage,
)
from pagedserve.gc_tuning import tune_gc
from scheduler_svc.front.grpc.server import start_grpc_server
from scheduler_svc.front.http.app import OpenAIFront
from scheduler_svc.front.http.asgi_app import build_app
from scheduler_svc.front.http.limits import HttpLimits
from scheduler_svc.front.http.serve import start_http_server
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.front.output.deltas import RequestStream
from scheduler_svc.front.output.mailbox import Tracked
from scheduler_svc.front.output.stream import OutputStream
from testing.tokenizers import small_tokenizer

STEP_S = 0.005
CLIENT = r"""
import asyncio, sys, grpc
from pagedserve.v1 import generation_pb2 as pb, generation_pb2_grpc as pb_grpc
async def one(stub, i, tokens):
    n = msgs = 0
    req = pb.GenerateRequest(request_id=f"r{i}", prompt_token_ids=[5, 6, 7],
                             sampling=pb.SamplingParams(max_tokens=tokens))
    async for r in stub.Generate(req):
        msgs += 1
        n += sum(len(c.token_ids) for c in r.choices)
    return n, msgs
async def main(port, streams, tokens):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = pb_grpc.GenerationStub(ch)
        res = await asyncio.gather(*(one(stub, i, tokens) for i in range(streams)))
    print(sum(r[0] for r in res), sum(r[1] for r in res))
asyncio.run(main(*map(int, sys.argv[1:])))
"""
HTTP_CLIENT = r"""
import asyncio, json, sys, aiohttp
async def one(session, url, tokens):
    n = msgs = 0
    body = {"prompt": [5, 6, 7], "max_tokens": tokens, "stream": True, "return_token_ids": True}
    async with session.post(url, json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: {"):
                msgs += 1
                n += sum(len(c.get("token_ids", ())) for c in json.loads(line[6:])["choices"])
    return n, msgs
async def main(port, streams, tokens):
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        res = await asyncio.gather(*(one(session, url, tokens) for i in range(streams)))
    print(sum(r[0] for r in res), sum(r[1] for r in res))
asyncio.run(main(*map(int, sys.argv[1:])))
"""


class TickingEngine:
    """The engine interface the servicer uses; every STEP_S each running request gets one token."""

    def __init__(self, tokenizer, tokens: int, stream_interval: int = 1) -> None:
        self.tokenizer, self.tokens, self.stream_interval = tokenizer, tokens, stream_interval
        self.running: dict[str, tuple[Tracked, list[int]]] = {}

    def model_info(self) -> ModelInfo:
        return ModelInfo("bench", "LlamaForCausalLM", 4096, self.tokenizer.get_vocab_size(), 16, 1)

    async def current_stats(self):
        return self.stats()

    def health_problem(self) -> str | None:
        return None

    def is_ready(self) -> bool:
        return True

    def stats(self):
        raise NotImplementedError

    def generate(self, req: GenerationRequest) -> OutputStream:
        return OutputStream(req, self._admit, self._abandon)

    def _admit(self, req: GenerationRequest) -> Tracked:
        t = Tracked(RequestStream(req, self.tokenizer, 1), self.stream_interval)  # as Engine._admit
        self.running[req.request_id] = (t, [0])
        return t

    def _abandon(self, t: Tracked) -> None:
        self.running.pop(t.request_id, None)

    async def tick(self) -> None:
        while True:
            await asyncio.sleep(STEP_S)
            for rid, (t, sent) in list(self.running.items()):
                sent[0] += 1
                last = sent[0] >= self.tokens
                t.put(RequestOutput(rid, [ChoiceDelta(0, "ab", [7], finish_reason=FinishReason.LENGTH if last
                                                      else FinishReason.UNSPECIFIED)],
                                    Usage(3, self.tokens, 0) if last else None, finished=last))
                if last:
                    del self.running[rid]


async def run_once(api: str, interval: int, streams: int, tokens: int, tokenizer) -> dict:
    engine = TickingEngine(tokenizer, tokens, interval)
    if api == "grpc":
        server = await start_grpc_server(engine, tokenizer, "127.0.0.1", 0, health_poll_interval=None)
        client_code, stop = CLIENT, server.shutdown(0.0)
    else:
        front = OpenAIFront(engine, tokenizer, None, ServerLimits(), HttpLimits(), None)
        server = await start_http_server(build_app(front), "127.0.0.1", 0)
        client_code, stop = HTTP_CLIENT, server.stop(0.5)
    ticker = asyncio.ensure_future(engine.tick())
    try:
        cpu0, t0 = time.process_time(), time.perf_counter()
        client = await asyncio.create_subprocess_exec(sys.executable, "-c", client_code, str(server.port),
                                                      str(streams), str(tokens), stdout=subprocess.PIPE)
        out, _ = await client.communicate()
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    finally:
        ticker.cancel()
        await stop
    got, messages = map(int, out.split())
    if got != streams * tokens:
        raise RuntimeError(f"{got} tokens streamed, expected {streams * tokens}")
    return {"us_per_token": 1e6 * cpu / got, "tokens_per_message": got / messages, "wall_s": wall}


def front_costs(api: str, intervals: list[int], streams: int, tokens: int, repeats: int) -> dict[str, float]:
    """Per interval k, the median of ``repeats`` runs (the intervals alternate run by run):
    ``us_per_token_interval_<k>`` (this process's CPU per streamed token) and
    ``tokens_per_message_interval_<k>``."""
    tokenizer, _ = small_tokenizer()
    tune_gc()
    runs: dict[int, list[dict]] = {k: [] for k in intervals}
    for _ in range(repeats):
        for k in intervals:
            runs[k].append(uvloop.run(run_once(api, k, streams, tokens, tokenizer)))
    out: dict[str, float] = {}
    for k in intervals:
        out[f"us_per_token_interval_{k}"] = round(statistics.median(r["us_per_token"] for r in runs[k]), 2)
        out[f"tokens_per_message_interval_{k}"] = round(statistics.median(r["tokens_per_message"] for r in runs[k]), 2)
    return out
