"""A streaming ``/v1/completions`` load generator that treats every server alike.

Used by benchmarks/cpu_vs_llamacpp.py against pagedserve's HTTP front and llama.cpp's
``llama-server``: prompts go as token ids (both servers accept them, so neither tokenizer is
involved), greedy, ``ignore_eos``, streamed; a token is one streamed event with text or token
ids, and the final usage chunk (``stream_options.include_usage``) is the count when present.
``run_closed_loop`` keeps ``concurrency`` requests in flight: each of as many workers sends
its requests one after another, each on a new connection (a server may close a streamed
response's connection, and a reused one would then fail).

The benchmark runs it as its own process (``python -m benchmarks.completions_client ...``,
:func:`run_in_subprocess`): without torch loaded and with the garbage collector off, so the
client's own CPU, on a machine where it shares the cores with the servers it measures, is
small and the same for every server.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp


@dataclass(slots=True)
class RequestTiming:
    sent: float
    first_token: float
    done: float
    tokens: int

    @property
    def seconds(self) -> float:
        return self.done - self.sent

    @property
    def time_per_output_token(self) -> float:
        """Decode time per token after the first (the stream's steady rate)."""
        return (self.done - self.first_token) / max(1, self.tokens - 1)


@dataclass(slots=True)
class LoadResult:
    concurrency: int
    wall_s: float
    requests: list[RequestTiming] = field(default_factory=list)
    cpu_s: float = 0.0  # the client process's own CPU over the run (set by run_in_subprocess)

    @property
    def output_tokens(self) -> int:
        return sum(r.tokens for r in self.requests)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def median_tpot_s(self) -> float:
        return statistics.median(r.time_per_output_token for r in self.requests)


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """``count`` distinct prompts of ``length`` random token ids in [1, vocab) (0 is EOS here)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(length)] for _ in range(count)]


async def _one(session: aiohttp.ClientSession, url: str, prompt: list[int], max_tokens: int) -> RequestTiming:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    first, events, usage = 0.0, 0, None
    async with session.post(url + "/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{url}: HTTP {resp.status}: {(await resp.text())[:500]}")
        async for raw in resp.content:
            line = raw.strip()
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            if chunk.get("usage"):
                usage = chunk["usage"].get("completion_tokens")
            choices = chunk.get("choices") or []
            if choices and (choices[0].get("text") or choices[0].get("token_ids")):
                events += 1
                if not first:
                    first = time.perf_counter()
    done = time.perf_counter()
    return RequestTiming(sent, first or done, done, usage if usage is not None else events)


async def _closed_loop(url: str, batches: list[list[list[int]]], max_tokens: int) -> LoadResult:
    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        async def worker(mine: list[list[int]]) -> list[RequestTiming]:
            return [await _one(session, url, p, max_tokens) for p in mine]

        start = time.perf_counter()
        per_worker = await asyncio.gather(*(worker(b) for b in batches))
        wall = time.perf_counter() - start
    return LoadResult(len(batches), wall, [r for rs in per_worker for r in rs])


def run_closed_loop(url: str, concurrency: int, per_worker: int, prompt_len: int, max_tokens: int, vocab: int,
                    seed: int) -> LoadResult:
    """``concurrency`` workers, each sending ``per_worker`` requests back to back."""
    ps = prompts(concurrency * per_worker, prompt_len, vocab, seed)
    batches = [ps[i * per_worker:(i + 1) * per_worker] for i in range(concurrency)]
    result = asyncio.run(_closed_loop(url, batches, max_tokens))
    short = [r.tokens for r in result.requests if r.tokens != max_tokens]
    if short:
        raise RuntimeError(f"{url}: {len(short)} responses did not stream {max_tokens} tokens (got {short[:5]})")
    return result


def _die_with_parent() -> None:
    """In the client process: SIGTERM when the benchmark that started it dies (Linux)."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


def run_in_subprocess(url: str, concurrency: int, per_worker: int, prompt_len: int, max_tokens: int, vocab: int,
                      seed: int) -> LoadResult:
    """:func:`run_closed_loop` in a fresh client process (see the module doc)."""
    out = subprocess.run([sys.executable, "-m", "benchmarks.completions_client", url, str(concurrency),
                          str(per_worker), str(prompt_len), str(max_tokens), str(vocab), str(seed)],
                         check=True, capture_output=True, text=True, preexec_fn=_die_with_parent)
    raw = json.loads(out.stdout.strip().splitlines()[-1])
    return LoadResult(raw["concurrency"], raw["wall_s"], [RequestTiming(**r) for r in raw["requests"]],
                      raw["cpu_s"])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="One closed-loop run; prints its timings as JSON.")
    for name in ("url", "concurrency", "per_worker", "prompt_len", "max_tokens", "vocab", "seed"):
        ap.add_argument(name, type=str if name == "url" else int)
    args = ap.parse_args(argv)
    gc.disable()  # (a short run: nothing cyclic worth collecting, and its pauses would be the client's noise)
    cpu = time.process_time()
    r = run_closed_loop(args.url, args.concurrency, args.per_worker, args.prompt_len, args.max_tokens, args.vocab,
                        args.seed)
    print(json.dumps({"concurrency": r.concurrency, "wall_s": r.wall_s, "cpu_s": time.process_time() - cpu,
                      "requests": [dataclasses.asdict(x) for x in r.requests]}))


if __name__ == "__main__":
    main()
