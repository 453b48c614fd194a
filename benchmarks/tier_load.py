"""The load generator processes of ``benchmarks/tier_capacity.py``: streaming clients, and
requests at every size limit the server states.

    python -m benchmarks.tier_load stream --api grpc|http --target HOST:PORT --vocab V --streams 256 --tokens 256
    python -m benchmarks.tier_load max-size --grpc HOST:PORT --http HOST:PORT --tokenizer FILE \\
        --http-max-body-bytes N --kv-blocks N [--repeats 2]

``stream`` drives ``--streams`` concurrent streaming requests through pagedserve-bench's own senders
(``pagedserve/bench/``: one gRPC channel, or one aiohttp connection per stream), 64-token random
prompts, greedy, EOS ignored, so every request streams exactly ``--tokens`` tokens.

``max-size`` builds a request at each of the server's size limits, says ``ready`` and, once a line
comes on stdin, sends them one after another. The limits are read from
``GetModelInfo`` (``max_model_len``, ``ServerLimits``) and from the transport bounds
(``--http-max-body-bytes``, gRPC's 4 MiB message): the ones within the limits run, the ones at a
transport bound are refused by the front. See :func:`max_size_requests`.

Each prints one JSON line: what it sent, what came back, and its own CPU seconds (all threads)
while it sent.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import aiohttp
import grpc
from tokenizers import Tokenizer

from pagedserve.bench.loadgen import fixed_trace, model_info, run_requests
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

PROMPT_TOKENS = 64
GRPC_MESSAGE_LIMIT = 4 * 1024 * 1024  # the server's gRPC request bound (scheduler_svc/front/grpc/server.py)
_GRPC_OPTIONS = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]


# ---------------------------------------------------------------------------- streaming clients


async def stream(api: str, target: str, streams: int, tokens: int, vocab: int, seed: int) -> dict:
    trace = fixed_trace(streams, (PROMPT_TOKENS, PROMPT_TOKENS), (tokens, tokens), math.inf, seed, vocab)
    sampling = pb.SamplingParams(temperature=0.0, ignore_eos=True)
    cpu = time.process_time()
    results, wall = await run_requests(target, trace, sampling, progress=False, timeout_s=3600.0, api=api)
    return {"cpu_s": time.process_time() - cpu, "tokens": sum(r.output_tokens for r in results),
            "messages": sum(len(r.chunk_tokens) for r in results),
            "failed": sum(1 for r in results if not r.ok),
            "errors": sorted({r.error for r in results if r.error})[:3], "wall_s": wall}


# ---------------------------------------------------------------------------- maximum-size requests


@dataclass(frozen=True, slots=True)
class MaxRequest:
    """One request at a size limit: its name, which limit, and how to send it."""

    name: str
    limit: str  # the bound it sits at, for the report
    send: Callable[[], Awaitable[str]]  # returns its outcome: "ok" or the status it got


def _ids(n: int, vocab: int, rng: random.Random) -> list[int]:
    return [rng.randrange(1, vocab) for _ in range(n)]


def text_of_tokens(tok: Tokenizer, n: int, rng: random.Random) -> str:
    """A text the tokenizer turns into at most ``n`` tokens, and not many fewer: decoded random ids,
    cut (binary search on characters) until its encoding fits."""
    vocab = tok.get_vocab_size()
    text = tok.decode(_ids(n + n // 4 + 16, vocab, rng))
    lo, hi = 0, len(text)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(tok.encode(text[:mid], add_special_tokens=False).ids) <= n:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo]


def max_size_requests(info: pb.ModelInfo, tok: Tokenizer, grpc_target: str, http_target: str,
                      http_max_body: int, kv_blocks: int, seed: int = 0) -> list[MaxRequest]:
    """Every body at a size limit, text and token ids:

    - the longest prompt of token ids the context takes (``max_model_len - 1``), gRPC and HTTP;
    - a text prompt of nearly as many tokens (tokenized by the front);
    - every other request limit at once: ``max_n`` choices with ``max_logprobs`` log-probs each,
      ``max_stop_strings`` stop strings of ``max_stop_string_len`` characters, ``max_stop_token_ids``,
      16 tokens each, on the longest prompt that the context and the executor's ``kv_blocks`` take
      at that width (the server counts every choice at full length);
    - a text prompt of a gRPC message's size (4 MiB), and one of ``--http-max-body-bytes``: refused
      by the front (more characters than the context can hold tokens), never reaching the core.
    """
    rng, lim, vocab = random.Random(seed), info.limits, info.vocab_size
    longest = info.max_model_len - 1
    ids = _ids(longest, vocab, rng)
    text = text_of_tokens(tok, longest - 1, rng)  # (the template of none adds no token; one spare)
    every = pb.SamplingParams(max_tokens=16, n=max(1, lim.max_n), logprobs=lim.max_logprobs, temperature=1.0,
                              seed=7, ignore_eos=True,
                              stop=["\u2603" * max(1, lim.max_stop_string_len)] * lim.max_stop_strings,
                              stop_token_ids=list(range(1, 1 + lim.max_stop_token_ids)))
    width = max(1, lim.max_n)
    room = int(0.95 * kv_blocks) // width * info.block_size  # (a watermark of blocks stays free)
    every_ids = _ids(min(info.max_model_len, room) - 16, vocab, rng)
    grpc_text = "a" * (GRPC_MESSAGE_LIMIT - 1024)
    http_text = "a" * (http_max_body - 1024)

    def grpc_call(msg: pb.GenerateRequest) -> Callable[[], Awaitable[str]]:
        return lambda: _grpc_generate(grpc_target, msg)

    def http_call(body: dict) -> Callable[[], Awaitable[str]]:
        return lambda: _http_complete(http_target, body)

    one = pb.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    return [
        MaxRequest("grpc token ids", f"max_model_len - 1 = {longest} ids",
                   grpc_call(pb.GenerateRequest(prompt_token_ids=ids, sampling=one))),
        MaxRequest("http token ids", f"max_model_len - 1 = {longest} ids",
                   http_call({"prompt": ids, "max_tokens": 1, "temperature": 0.0})),
        MaxRequest("http text", f"~{longest} tokens of text ({len(text)} chars)",
                   http_call({"prompt": text, "max_tokens": 1, "temperature": 0.0})),
        MaxRequest("grpc every limit", f"n={every.n}, logprobs={every.logprobs}, "
                                       f"{len(every.stop)}x{lim.max_stop_string_len}-char stops, "
                                       f"{len(every.stop_token_ids)} stop ids, {len(every_ids)} ids",
                   grpc_call(pb.GenerateRequest(prompt_token_ids=every_ids, sampling=every))),
        MaxRequest("grpc text at the message bound", f"{len(grpc_text)} chars (4 MiB message)",
                   grpc_call(pb.GenerateRequest(prompt=grpc_text, sampling=one))),
        MaxRequest("http text at the body bound", f"{len(http_text)} chars (--http-max-body-bytes)",
                   http_call({"prompt": http_text, "max_tokens": 1})),
    ]


async def _grpc_generate(target: str, msg: pb.GenerateRequest) -> str:
    async with grpc.aio.insecure_channel(target, options=_GRPC_OPTIONS) as ch:
        try:
            async for _ in pb_grpc.GenerationStub(ch).Generate(msg, timeout=600):
                pass
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {(exc.details() or '')[:120]}"
    return "ok"


async def _http_complete(target: str, body: dict) -> str:
    async with aiohttp.ClientSession() as session:
        async with session.post(f"http://{target}/v1/completions", json=body) as resp:
            body = await resp.read()
            return "ok" if resp.status == 200 else f"HTTP {resp.status}: {body[:120].decode(errors='replace')}"


async def max_size(grpc_target: str, http_target: str, tokenizer: str, http_max_body: int, kv_blocks: int,
                   repeats: int, only: str | None = None) -> dict:
    """Build the requests (``only``: the one of that name), say ``ready``, wait for a line on stdin
    (the benchmark starts its window), then send them."""
    info = await model_info(grpc_target)
    reqs = max_size_requests(info, Tokenizer.from_file(tokenizer), grpc_target, http_target, http_max_body,
                             kv_blocks)
    if only is not None:
        reqs = [r for r in reqs if r.name == only]
        if not reqs:
            raise SystemExit(f"--only: no request named {only!r}")
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)
    cpu, sent = time.process_time(), []
    for _ in range(repeats):
        for r in reqs:
            t0 = time.perf_counter()
            outcome = await r.send()
            sent.append({"name": r.name, "limit": r.limit, "outcome": outcome,
                         "seconds": round(time.perf_counter() - t0, 3)})
    return {"cpu_s": time.process_time() - cpu, "requests": sent}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("stream")
    s.add_argument("--api", choices=("grpc", "http"), required=True)
    s.add_argument("--target", required=True, help="host:port of the API")
    s.add_argument("--streams", type=int, default=256)
    s.add_argument("--tokens", type=int, default=256, help="tokens each stream generates")
    s.add_argument("--vocab", type=int, required=True, help="prompt token ids are drawn below this")
    s.add_argument("--seed", type=int, default=0)
    m = sub.add_parser("max-size")
    m.add_argument("--grpc", required=True)
    m.add_argument("--http", required=True)
    m.add_argument("--tokenizer", required=True, help="the served model's tokenizer.json")
    m.add_argument("--http-max-body-bytes", type=int, required=True)
    m.add_argument("--kv-blocks", type=int, required=True, help="the executor's KV blocks")
    m.add_argument("--repeats", type=int, default=1)
    m.add_argument("--only", help="send only the request of this name (e.g. 'grpc token ids')")
    a = ap.parse_args(argv)
    if a.mode == "stream":
        out = asyncio.run(stream(a.api, a.target, a.streams, a.tokens, a.vocab, a.seed))
    else:
        out = asyncio.run(max_size(a.grpc, a.http, a.tokenizer, a.http_max_body_bytes, a.kv_blocks, a.repeats,
                                   a.only))
    print(json.dumps(out), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
