"""The whole stack serving streams (``make gpu-check``'s ``stack``): a scheduler process and an
executor process, as deployed, and greedy gRPC streams of 128 tokens at 1, 64 and 256 streams.

On the GPU the model is the 1.1B-shaped Llama of ``testing/kernels/executor_steps.py`` with a
word-level tokenizer of its vocabulary (``testing/shaped_models.py``): random weights, so EOS is
ignored and every stream runs its full length. The stack has two gRPC fronts (``--api-server-count 2``); the clients are
grpc.aio (``pagedserve/bench/loadgen.py``) in four processes that start sending together, so that
neither a front nor a client is what is measured (each streams ~30k tokens/s on a core). A
round's tokens per second count from its first request sent to its last token received. One warm-up round, then
``reps`` rounds per stream count: the median.

On the CPU the same code serves a small shaped model (``--device cpu``): what the tests check.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import statistics
import tempfile
from pathlib import Path

STREAMS = (1, 64, 256)
TOKENS = 128
PROMPT = 128


def _client(conn, target: str) -> None:
    """A client process: for each trace it is sent, says it is ready, waits for "go", streams the
    trace and sends back (first send, last token, tokens, errors); perf_counter is one clock for
    every process. None ends it. Whatever it raises goes back as the round's error."""
    import traceback

    from pagedserve.bench.loadgen import run_requests
    from pagedserve.v1 import generation_pb2 as pb

    sampling = pb.SamplingParams(temperature=0.0, ignore_eos=True)
    while (trace := conn.recv()) is not None:
        conn.send("ready")
        conn.recv()
        try:
            results, _ = asyncio.run(run_requests(target, trace, sampling, progress=False, timeout_s=600.0))
            conn.send((min(r.send_time for r in results), max(r.end_time for r in results),
                       sum(r.output_tokens for r in results),
                       sorted({r.error for r in results if not r.ok and r.error})))
        except Exception:  # noqa: BLE001  the parent raises it with the round
            conn.send((0.0, 0.0, 0, [f"client process: {traceback.format_exc(limit=3)}"]))


class Clients:
    """``n`` client processes that send each round's streams together (one grpc.aio client streams
    ~30k tokens/s on a core: a single one would be what is measured)."""

    def __init__(self, target: str, n: int) -> None:
        import multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.pipes, self.procs = [], []
        for _ in range(n):
            parent, child = ctx.Pipe()
            self.procs.append(ctx.Process(target=_client, args=(child, target), daemon=True))
            self.procs[-1].start()
            self.pipes.append(parent)

    def round(self, trace: list, timeout_s: float = 600.0) -> float:
        """Tokens per second of ``trace`` (greedy, EOS ignored), from the first request sent to the
        last token received; every stream must deliver all its tokens."""
        active = self.pipes[:len(trace)]
        for k, p in enumerate(active):
            p.send(trace[k::len(active)])
        for p in active:
            if not p.poll(120) or p.recv() != "ready":
                raise RuntimeError("a client process did not start")
        for p in active:
            p.send("go")
        parts = [p.recv() if p.poll(timeout_s) else None for p in active]
        if None in parts:
            raise RuntimeError(f"{len(trace)} streams: a client process gave no result in {timeout_s:.0f}s")
        want = sum(r.output_len for r in trace)
        got, errors = sum(p[2] for p in parts), sorted({e for p in parts for e in p[3]})
        if errors or got != want:
            raise RuntimeError(f"{len(trace)} streams: {got} of {want} tokens, errors {errors[:3]}")
        return got / (max(p[1] for p in parts) - min(p[0] for p in parts))

    def close(self) -> None:
        for p in self.pipes:
            with contextlib.suppress(OSError):  # (a client that died has closed its end)
                p.send(None)
        for proc in self.procs:
            proc.join(10)
            if proc.is_alive():
                proc.kill()


def measure(model_dir: Path, executor_args: list[str], streams: tuple[int, ...] = STREAMS, tokens: int = TOKENS,
            prompt: int = PROMPT, reps: int = 3, model_name: str = "llama-1.1b-shape", fronts: int = 2,
            clients: int = 4, logdir: Path | None = None) -> list[dict]:
    """``{model, streams, tok_s, runs}`` per stream count, the stack started once for all of them.
    ``executor_args``: the executor's device flags (``--device cuda --dtype bfloat16 ...``);
    ``fronts``: the scheduler's ``--api-server-count`` (a gRPC front streams ~30k tokens/s on a core);
    ``clients``: client processes sharing the streams."""
    from pagedserve.bench.loadgen import fixed_trace
    from pagedserve.v1 import generation_pb2 as pb
    from testing.stack import Stack

    with tempfile.TemporaryDirectory() as tmp:
        logs = logdir or Path(tmp)
        stack = Stack(model_dir, logs, ["--max-num-seqs", str(max(16, *streams)), "--api-server-count", str(fronts),
                                         "--log-level", "WARNING"])
        try:
            stack.start_scheduler()
            stack.start_executor("ex0", *executor_args)
            stack.wait_health()
            vocab = stack.stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=10).vocab_size
            pool = Clients(f"127.0.0.1:{stack.port}", clients)
            try:
                def trace(n: int, out: int, seed: int) -> list:
                    return fixed_trace(n, (prompt, prompt), (out, out), math.inf, seed, vocab)

                pool.round(trace(max(streams), min(tokens, 16), 99))  # warm-up: every batch shape once
                rows = []
                for n in streams:
                    runs = [pool.round(trace(n, tokens, rep)) for rep in range(reps)]
                    rows.append({"model": model_name, "streams": n, "tok_s": round(statistics.median(runs), 1),
                                 "runs": [round(r, 1) for r in runs]})
                    print(f"  stack, {n} streams: {rows[-1]['tok_s']:.0f} tok/s", flush=True)
            finally:
                pool.close()
            stack.wait_blocks_free()
            return rows
        except Exception as exc:
            raise RuntimeError(f"{exc}\n{stack.logs()}") from exc
        finally:
            stack.stop()

