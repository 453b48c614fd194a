"""``pagedserve-bench``: a load generator for a running pagedserve deployment.

    pagedserve-bench --server localhost:50051 --workload sharegpt --num-requests 200 --rate 2 \\
        --out result.json
    pagedserve-bench --server HOST:PORT --workload fixed --input-len 32:256 --output-len 32:128 \\
        --num-requests 64 --rate inf
    pagedserve-bench --api grpc,http --http-server localhost:8000 --repeat 5 ...   # both fronts

Requests are built from pagedserve/bench/workloads.py (ShareGPT-like, Alpaca-like,
shared-prefix traces with Poisson arrivals) or a fixed/uniform length range,
with prompts as random token ids from the vocabulary GetModelInfo reports, so
prompt lengths are exact; with ``--ignore-eos`` (the default) output lengths
are exact too. Each request is one streaming ``Generate`` call over grpc.aio
(``--api grpc``, the default) or one streaming ``POST /v1/completions`` to the
OpenAI-compatible API (``--api http``, pagedserve/bench/http_client.py);
``--max-concurrency`` caps the calls in flight; latencies count from the
moment a call is sent, so time spent waiting for a free slot is not included.
``--api grpc,http --repeat R`` sends the same trace through each front in turn,
R times (the order alternating), and reports the median run of each side by side.
The report (stdout, and JSON with ``--out``) is described in
pagedserve/bench/stats.py.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import numpy as np
from tqdm.auto import tqdm

from pagedserve.bench import workloads
from pagedserve.bench.stats import (
    RequestResult,
    compare_runs,
    format_comparison,
    format_report,
    json_safe,
    summarize,
)
from pagedserve.bench.workloads import TraceRequest
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc

WORKLOADS = ("sharegpt", "alpaca", "shared-prefix", "fixed")
APIS = ("grpc", "http")
_FIRST_TOKEN_ID = 1  # id 0 is often EOS/pad; random prompts avoid it
_GRPC_OPTIONS = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]


def parse_range(text: str, name: str) -> tuple[int, int]:
    """``"128"`` -> (128, 128); ``"32:256"`` -> (32, 256), both ends included."""
    try:
        parts = [int(p) for p in text.split(":")]
    except ValueError:
        raise ValueError(f"{name} must be N or LO:HI with integers, got {text!r}") from None
    if len(parts) not in (1, 2):
        raise ValueError(f"{name} must be N or LO:HI, got {text!r}")
    lo, hi = parts[0], parts[-1]
    if not 1 <= lo <= hi:
        raise ValueError(f"{name} must satisfy 1 <= LO <= HI, got {text!r}")
    return lo, hi


def parse_rate(text: str) -> float:
    rate = float(text)
    if not rate > 0:
        raise ValueError(f"--rate must be > 0 requests/s or inf, got {text!r}")
    return rate


def parse_apis(text: str) -> tuple[str, ...]:
    apis = tuple(a.strip() for a in text.split(","))
    if not apis or any(a not in APIS for a in apis) or len(set(apis)) != len(apis):
        raise ValueError(f"--api must be grpc, http or grpc,http, got {text!r}")
    return apis


def fixed_trace(num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int], rate: float,
                seed: int, vocab_size: int) -> list[TraceRequest]:
    """Prompt and output lengths uniform in the given inclusive ranges; Poisson arrivals (rate inf: all at 0)."""
    if vocab_size <= _FIRST_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {_FIRST_TOKEN_ID}, got {vocab_size}")
    rng = np.random.default_rng(seed)
    ins = rng.integers(input_len[0], input_len[1] + 1, size=num_requests)
    outs = rng.integers(output_len[0], output_len[1] + 1, size=num_requests)
    arrivals = (np.zeros(num_requests) if math.isinf(rate)
                else workloads.poisson_arrivals(rate, num_requests, rng))
    return [TraceRequest(f"fixed-{seed}-{i}", float(arrivals[i]),
                         tuple(rng.integers(_FIRST_TOKEN_ID, vocab_size, size=int(ins[i])).tolist()),
                         int(outs[i]))
            for i in range(num_requests)]


def build_trace(workload: str, num_requests: int, rate: float, seed: int, vocab_size: int,
                max_model_len: int, input_len: tuple[int, int] = (128, 128),
                output_len: tuple[int, int] = (128, 128), prefix_len: int = 512,
                num_prefixes: int = 4) -> list[TraceRequest]:
    """The requests of a run, lengths clipped so prompt + output fits ``max_model_len``."""
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if workload not in WORKLOADS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {workload!r}")
    poisson_rate = 1.0 if math.isinf(rate) else rate  # arrivals are zeroed below for rate inf
    if workload == "fixed":
        trace = fixed_trace(num_requests, input_len, output_len, rate, seed, vocab_size)
    elif workload == "shared-prefix":
        trace = workloads.shared_prefix_trace(num_requests, poisson_rate, seed, num_prefixes, prefix_len,
                                              vocab_size=vocab_size)
    else:
        trace = workloads.synthetic_trace(workload, num_requests, poisson_rate, seed, vocab_size=vocab_size)
    return [_fit(r, max_model_len, 0.0 if math.isinf(rate) else r.arrival_time) for r in trace]


def _fit(r: TraceRequest, max_model_len: int, arrival: float) -> TraceRequest:
    prompt = r.prompt_token_ids[:max_model_len - 1]
    return dataclasses.replace(r, arrival_time=arrival, prompt_token_ids=prompt,
                               output_len=max(1, min(r.output_len, max_model_len - len(prompt))))


async def _one(send, req: TraceRequest, start: float, sem: asyncio.Semaphore) -> RequestResult:
    res = RequestResult(req.request_id, req.prompt_len, req.output_len)
    await asyncio.sleep(max(0.0, start + req.arrival_time - time.perf_counter()))
    async with sem:
        res.send_time = time.perf_counter()
        await send(req, res, time.perf_counter)
        res.end_time = time.perf_counter()
    return res


@contextlib.asynccontextmanager
async def grpc_sender(server: str, sampling: pb.SamplingParams, timeout_s: float) -> AsyncIterator:
    """``send(req, res, now)`` streams one ``Generate`` call into ``res``."""
    run_tag = f"bench{os.getpid()}"  # request ids stay unique when several clients share a server
    async with grpc.aio.insecure_channel(server, options=_GRPC_OPTIONS) as channel:
        stub = pb_grpc.GenerationStub(channel)

        async def send(req: TraceRequest, res: RequestResult, now) -> None:
            sp = pb.SamplingParams()
            sp.CopyFrom(sampling)
            sp.max_tokens = req.output_len
            msg = pb.GenerateRequest(request_id=f"{run_tag}-{req.request_id}",
                                     prompt_token_ids=req.prompt_token_ids, sampling=sp)
            try:
                async for resp in stub.Generate(msg, timeout=timeout_s):
                    n = sum(len(c.token_ids) for c in resp.choices)
                    if n:
                        res.chunk_times.append(now())
                        res.chunk_tokens.append(n)
            except grpc.aio.AioRpcError as e:
                res.error = f"{e.code().name}: {e.details()}"

        yield send


def _sender(api: str, server: str, sampling: pb.SamplingParams, timeout_s: float):
    if api == "http":
        from pagedserve.bench.http_client import http_sender  # aiohttp: only this front needs it

        return http_sender(server, sampling, timeout_s)
    return grpc_sender(server, sampling, timeout_s)


async def run_requests(server: str, trace: list[TraceRequest], sampling: pb.SamplingParams,
                       max_concurrency: int | None = None, progress: bool = True,
                       timeout_s: float = 3600.0, api: str = "grpc") -> tuple[list[RequestResult], float]:
    """Send ``trace`` to ``server`` through ``api`` on its arrival schedule; (results in trace order, wall seconds)."""
    limit = max_concurrency if max_concurrency else max(1, len(trace))
    sem = asyncio.Semaphore(limit)
    async with _sender(api, server, sampling, timeout_s) as send:
        start = time.perf_counter()
        tasks = [asyncio.ensure_future(_one(send, r, start, sem)) for r in trace]
        with tqdm(total=len(tasks), desc=f"requests ({api})", unit="req", disable=not progress) as bar:
            for fut in asyncio.as_completed(tasks):
                await fut
                bar.update(1)
        results = [t.result() for t in tasks]
    end = max((r.end_time for r in results), default=start)
    return results, max(end - start, 1e-9)


async def model_info(server: str, timeout_s: float = 10.0) -> pb.ModelInfo:
    async with grpc.aio.insecure_channel(server, options=_GRPC_OPTIONS) as channel:
        return await pb_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s)


def sampling_params(args: argparse.Namespace) -> pb.SamplingParams:
    sp = pb.SamplingParams(temperature=args.temperature, ignore_eos=args.ignore_eos)
    if args.top_p is not None:
        sp.top_p = args.top_p
    return sp


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="pagedserve-bench",
                                 description="Load a running pagedserve deployment with a request trace "
                                             "and report throughput and latency.")
    ap.add_argument("--server", default="localhost:50051",
                    help="host:port of the pagedserve gRPC API (also where the model is described)")
    ap.add_argument("--api", type=parse_apis, default=("grpc",),
                    help="front(s) to drive: grpc, http, or grpc,http for both side by side")
    ap.add_argument("--http-server", default="localhost:8000",
                    help="host:port (or URL) of the OpenAI-compatible HTTP API, for --api http")
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs per front (alternating order); the report is the median run of each")
    ap.add_argument("--workload", choices=WORKLOADS, default="sharegpt")
    ap.add_argument("--num-requests", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0, help="seeds lengths, prompt tokens and arrivals")
    ap.add_argument("--rate", type=parse_rate, default=math.inf,
                    help="Poisson arrival rate in requests/s; inf (default) sends all at once")
    ap.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    ap.add_argument("--input-len", default="128", help="fixed workload: prompt length N or range LO:HI")
    ap.add_argument("--output-len", default="128", help="fixed workload: output length N or range LO:HI")
    ap.add_argument("--prefix-len", type=int, default=512, help="shared-prefix workload: prefix tokens")
    ap.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix workload: distinct prefixes")
    ap.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                    help="generate exactly the requested output length (default on)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--top-p", type=float, default=None)
    ap.add_argument("--request-timeout", type=float, default=3600.0, help="per-request deadline, seconds")
    ap.add_argument("--out", type=Path, default=None, help="write the summary and settings as JSON here")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return ap


async def _amain(args: argparse.Namespace) -> dict:
    info = await model_info(args.server)
    if info.num_executors == 0:
        print("warning: the server reports no connected executor; requests will fail", file=sys.stderr)
    if "http" in args.api:
        from pagedserve.bench.http_client import http_model_check

        await http_model_check(args.http_server)
    trace = build_trace(args.workload, args.num_requests, args.rate, args.seed, info.vocab_size,
                        info.max_model_len, parse_range(args.input_len, "--input-len"),
                        parse_range(args.output_len, "--output-len"), args.prefix_len, args.num_prefixes)
    runs: dict[str, list[dict]] = {api: [] for api in args.api}
    for rep in range(args.repeat):
        for api in (args.api if rep % 2 == 0 else args.api[::-1]):  # alternate: drift hits both fronts
            server = args.http_server if api == "http" else args.server
            results, duration = await run_requests(server, trace, sampling_params(args), args.max_concurrency,
                                                   not args.no_progress, args.request_timeout, api)
            runs[api].append(summarize(results, duration))
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    if len(args.api) == 1 and args.repeat == 1:
        return {"settings": settings, "model": info.model_name, "summary": runs[args.api[0]][0]}
    return {"settings": settings, "model": info.model_name, "runs": runs, "comparison": compare_runs(runs)}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.num_requests < 1:
        raise SystemExit(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise SystemExit(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    if args.repeat < 1:
        raise SystemExit(f"--repeat must be >= 1, got {args.repeat}")
    try:
        report = asyncio.run(_amain(args))
    except grpc.aio.AioRpcError as e:
        raise SystemExit(f"cannot reach {args.server}: {e.code().name}: {e.details()}") from None
    except (ValueError, ConnectionError) as e:
        raise SystemExit(str(e)) from None
    title = f"pagedserve-bench: {args.workload} on {report['model']}"
    if "summary" in report:
        print(format_report(report["summary"], title))
    else:
        print(format_comparison(report["comparison"], title))
    if args.out is not None:
        report["settings"]["rate"] = str(args.rate)  # JSON has no inf
        args.out.write_text(json.dumps(json_safe(report), indent=2, allow_nan=False) + "\n")
    summaries = [report["summary"]] if "summary" in report else [r for rs in report["runs"].values() for r in rs]
    return 1 if any(s["failed"] for s in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
