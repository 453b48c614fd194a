"""``pagedserve-bench --api http``: the same requests as gRPC, through the OpenAI-compatible API.

Each request is one streaming ``POST /v1/completions`` with the prompt as token ids and
``return_token_ids`` (a vLLM extension the server implements), so every SSE chunk says how
many tokens it carries, exactly as a gRPC message does: the two fronts are measured with the
same statistics. aiohttp parses HTTP in C, which keeps the client's own cost low.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp

from pagedserve.bench.stats import RequestResult
from pagedserve.bench.workloads import TraceRequest
from pagedserve.v1 import generation_pb2 as pb

Send = Callable[[TraceRequest, RequestResult, Callable[[], float]], Awaitable[None]]


def completion_body(req: TraceRequest, sampling: pb.SamplingParams) -> dict:
    """The OpenAI body equivalent to the gRPC request the bench would send."""
    body = {"prompt": list(req.prompt_token_ids), "max_tokens": req.output_len, "stream": True,
            "return_token_ids": True, "ignore_eos": sampling.ignore_eos}
    for name in ("temperature", "top_p"):
        if sampling.HasField(name):
            body[name] = getattr(sampling, name)
    return body


@contextlib.asynccontextmanager
async def http_sender(server: str, sampling: pb.SamplingParams, timeout_s: float) -> AsyncIterator[Send]:
    """``send(req, res, now)`` streams one request to ``server`` (host:port or URL) into ``res``."""
    base = server if server.startswith(("http://", "https://")) else f"http://{server}"
    url = base.rstrip("/") + "/v1/completions"
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:

        async def send(req: TraceRequest, res: RequestResult, now: Callable[[], float]) -> None:
            try:
                async with session.post(url, json=completion_body(req, sampling)) as resp:
                    if resp.status != 200:
                        res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                        return
                    async for line in resp.content:  # one SSE line at a time
                        if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            res.error = f"stream error: {chunk['error'].get('message')}"
                            return
                        n = sum(len(c.get("token_ids", ())) for c in chunk.get("choices", ()))
                        if n:
                            res.chunk_times.append(now())
                            res.chunk_tokens.append(n)
            except (aiohttp.ClientError, TimeoutError) as e:
                res.error = f"{type(e).__name__}: {e}"

        yield send


async def http_model_check(server: str, timeout_s: float = 10.0) -> None:
    """Fail early, with the reason, when the HTTP API is not reachable."""
    base = server if server.startswith(("http://", "https://")) else f"http://{server}"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout_s)) as session:
        async with session.get(base.rstrip("/") + "/v1/models") as resp:
            if resp.status != 200:
                raise ConnectionError(f"{base}/v1/models: HTTP {resp.status}: {(await resp.text())[:200]}")
