"""pagedserve end to end against Hugging Face transformers on CPU, same model, same workload.

    .venv/bin/python -m benchmarks.serve_vs_hf [--quick] [--threads 2] [--out result.json]

One workload (default: 64 requests, prompts of 32-256 random tokens, outputs of
32-128 tokens, EOS ignored, greedy, all requests at once) on the embedded
default tiny model (models/tiny-llama, built if missing), float32 on CPU:

* pagedserve: real scheduler and executor processes; the requests go over
  gRPC from a separate ``pagedserve-bench`` process (pagedserve/bench/loadgen.py). The executor
  runs torch with ``--threads`` threads (OMP_NUM_THREADS), the scheduler with 1.
* transformers ``generate`` with static left-padded batches; every batch size
  in ``--batch-sizes`` is tried in the first repetition, the best one is kept
  for the others (its median is reported).
* transformers' continuous batching (testing/hf_baselines.py).

The transformers runs use ``torch.set_num_threads(--threads)`` in this
process. Repetitions interleave the systems, so load drift on a shared
machine hits all of them alike; each system's number is the median over
``--reps``. Throughput is useful output tokens (the lengths asked for) per
second of generation. A table is printed, then one JSON line (last line).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from benchmarks.proc_stat import children, cpu_seconds
from pagedserve.bench.loadgen import fixed_trace, parse_range
from pagedserve.bench.workloads import TraceRequest
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc
from testing import hf_baselines
from testing.hf_baselines import format_table, report

DEFAULT_MODEL = Path("models/tiny-llama")


def ensure_model(path: Path) -> Path:
    """``path`` itself, after building the default tiny Llama there if it holds no checkpoint."""
    if not (path / "config.json").exists():
        from executor_svc.tiny_model import build_tiny_model

        print(f"building the default tiny model into {path} ...", flush=True)
        build_tiny_model(path, "llama", "default")
    return path


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    """In the child: get SIGTERM when this benchmark dies (even by SIGKILL, e.g. a runner's timeout)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG


class ServeProcesses:
    """A scheduler and one CPU executor started as ``python -m ...`` with logs in a temp dir."""

    def __init__(self, model: Path, threads: int, sched_args: list[str], exec_args: list[str]) -> None:
        self.port, exec_port = _free_port(), _free_port()
        self.logdir = Path(tempfile.mkdtemp(prefix="serve_vs_hf-"))
        py = sys.executable
        self.procs = [
            self._spawn("scheduler", 1, [py, "-m", "scheduler_svc", "--model", str(model), "--host", "127.0.0.1",
                                         "--port", str(self.port), "--executor-host", "127.0.0.1",
                                         "--executor-port", str(exec_port), "--metrics-port", "0",
                                         "--disable-prefix-caching", "--http-port", "0", "--log-level", "WARNING",
                                         *sched_args]),
            self._spawn("executor", threads, [py, "-m", "executor_svc", "--model", str(model), "--scheduler",
                                              f"tcp://127.0.0.1:{exec_port}", "--device", "cpu",
                                              "--dtype", "float32", "--swap-space", "0", "--health-port", "0",
                                              "--log-level", "WARNING", *exec_args]),
        ]

    def _spawn(self, name: str, threads: int, argv: list[str]) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
        log = open(self.logdir / f"{name}.log", "wb")
        return subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=_die_with_parent)

    @property
    def server(self) -> str:
        return f"127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.server) as ch:
            stub = pb_grpc.GenerationStub(ch)
            while time.monotonic() < deadline:
                if any(p.poll() is not None for p in self.procs):
                    raise RuntimeError(f"a pagedserve process exited early; logs in {self.logdir}")
                try:
                    if stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=2).num_executors >= 1:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.5)
        raise TimeoutError(f"pagedserve not ready after {timeout_s:.0f}s; logs in {self.logdir}")

    def cpu_seconds(self) -> dict[str, float]:
        """User + system CPU seconds so far of the scheduler and the executor (Linux /proc; else empty).
        The scheduler's include its live children: the front processes it starts serve the APIs."""
        out = {}
        for name, p in zip(("scheduler", "executor"), self.procs, strict=True):
            try:
                out[name] = cpu_seconds(p.pid)
            except OSError:
                return {}
            for child in children(p.pid) if name == "scheduler" else ():
                with contextlib.suppress(OSError):  # (a child that ended meanwhile)
                    out[name] += cpu_seconds(child)
        return out

    def stop(self) -> None:
        for p in reversed(self.procs):  # executor first, then the scheduler
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def run_pagedserve(stack: ServeProcesses, num_requests: int, input_len: str, output_len: str,
                   seed: int) -> hf_baselines.RunResult:
    """The fixed workload, all at once, through ``pagedserve-bench`` in its own process (greedy, EOS
    ignored): a separate client process keeps gRPC's threads out of the transformers runs here."""
    server = stack.server
    cpu0, child0 = stack.cpu_seconds(), _children_cpu()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        subprocess.run([sys.executable, "-m", "pagedserve.bench.loadgen", "--server", server, "--workload", "fixed",
                        "--num-requests", str(num_requests), "--input-len", input_len, "--output-len", output_len,
                        "--seed", str(seed), "--rate", "inf", "--no-progress", "--out", str(out)],
                       check=True, stdout=subprocess.DEVNULL, env=dict(os.environ, OMP_NUM_THREADS="1"))
        summary = json.loads(out.read_text())["summary"]
    if summary["failed"] or summary["short_outputs"]:
        raise RuntimeError(f"pagedserve: {summary['failed']} failed, {summary['short_outputs']} short; "
                           f"errors {summary['errors']}")
    cpu = {k: v - cpu0[k] for k, v in stack.cpu_seconds().items()}
    cpu["client (incl. startup)"] = _children_cpu() - child0
    return hf_baselines.RunResult("pagedserve", summary["duration_s"], summary["total_output_tokens"],
                                  summary["total_output_tokens"], cpu)


def _children_cpu() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--quick", action="store_true",
                    help="16 requests, batch sizes 8/16, 1 repetition (a smoke run, a few minutes)")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--input-len", default="32:256", help="prompt length range LO:HI (tokens)")
    ap.add_argument("--output-len", default="32:128", help="output length range LO:HI (tokens)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3, help="repetitions; each system's median is reported")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of the pagedserve executor and of the transformers runs (default 1: "
                         "on a small shared machine, 2 OpenMP threads on 2 busy cores run 5-7x slower)")
    ap.add_argument("--batch-sizes", default="8,16,32,64", help="static generate batch sizes to try")
    ap.add_argument("--hf-cb-max-batch-tokens", type=int, default=512,
                    help="transformers continuous batching: tokens per forward pass")
    ap.add_argument("--kv-cache-memory", default="512MiB", help="pagedserve executor KV cache size")
    ap.add_argument("--max-num-seqs", type=int, default=256, help="pagedserve scheduler: sequences per step")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048,
                    help="pagedserve scheduler: tokens per step (chunked prefill budget)")
    ap.add_argument("--skip", default="", help="comma list of systems to leave out: static,cb")
    ap.add_argument("--out", type=Path, default=None, help="also write the JSON result here")
    return ap


def _settings(args: argparse.Namespace) -> argparse.Namespace:
    if args.quick:
        args.num_requests, args.reps, args.batch_sizes = min(args.num_requests, 16), 1, "8,16"
    if args.num_requests < 1 or args.reps < 1 or args.threads < 1:
        raise SystemExit("--num-requests, --reps and --threads must be >= 1")
    args.batch_sizes = [int(b) for b in str(args.batch_sizes).split(",") if b]
    args.skip = {s for s in args.skip.split(",") if s}
    if args.skip - {"static", "cb"}:
        raise SystemExit(f"--skip takes static and/or cb, got {sorted(args.skip)}")
    return args


def _with_cpu(fn, *a) -> hf_baselines.RunResult:
    """``fn(*a)`` with the CPU seconds of this process (all its threads) recorded."""
    start = time.process_time()
    res = fn(*a)
    res.cpu_s = {"transformers process": time.process_time() - start}
    return res


def _log(res: hf_baselines.RunResult, rep: int, runs: dict) -> None:
    cpu = ", ".join(f"{k} {v:.1f}" for k, v in res.cpu_s.items())
    runs["cpu_s"].append({"rep": rep + 1, "system": res.name, "wall_s": res.wall_s, **res.cpu_s})
    print(f"[rep {rep + 1}] {res.name:<24} {res.tokens_per_s:8.1f} tok/s  ({res.useful_tokens} tokens "
          f"in {res.wall_s:.1f}s; CPU s: {cpu})", flush=True)


def _repetitions(args, stack: ServeProcesses, model, trace: list[TraceRequest], pad_id: int) -> dict[str, list]:
    """Every system's tok/s per repetition, interleaved; static tries all batch sizes in repetition 1."""
    runs: dict[str, list] = {"pagedserve": [], "hf_cb": [], "cpu_s": []}
    static: dict[int, list[float]] = {b: [] for b in args.batch_sizes}
    best = None  # the static batch size chosen after repetition 1, kept for the others
    for rep in range(args.reps):
        res = run_pagedserve(stack, len(trace), args.input_len, args.output_len, args.seed)
        if res.useful_tokens != sum(r.output_len for r in trace):
            raise RuntimeError(f"pagedserve generated {res.useful_tokens} tokens, the trace asks for "
                               f"{sum(r.output_len for r in trace)}: client and trace disagree")
        runs["pagedserve"].append(res.tokens_per_s)
        _log(res, rep, runs)
        if "static" not in args.skip:
            for b in args.batch_sizes if rep == 0 else [best]:
                res = _with_cpu(hf_baselines.run_static, model, trace, b, pad_id)
                static[b].append(res.tokens_per_s)
                _log(res, rep, runs)
            best = best or max(static, key=lambda b: static[b][0])
        if "cb" not in args.skip:
            res = _with_cpu(hf_baselines.run_continuous, model, trace, args.hf_cb_max_batch_tokens)
            runs["hf_cb"].append(res.tokens_per_s)
            _log(res, rep, runs)
    runs["hf_static"] = {b: v for b, v in static.items() if v}
    return runs


def measure(args: argparse.Namespace) -> dict:
    """Start pagedserve, load transformers, warm both up, run the repetitions; the result dict."""
    model_dir = ensure_model(args.model)
    cfg = json.loads((model_dir / "config.json").read_text())
    eos = cfg.get("eos_token_id")
    pad_id = eos if isinstance(eos, int) else 0
    trace = fixed_trace(args.num_requests, parse_range(args.input_len, "--input-len"),
                        parse_range(args.output_len, "--output-len"), float("inf"), args.seed, cfg["vocab_size"])
    warm = fixed_trace(4, (16, 48), (8, 8), float("inf"), args.seed + 1000, cfg["vocab_size"])  # as below
    torch.set_num_threads(args.threads)  # the transformers runs in this process
    stack = ServeProcesses(model_dir, args.threads,
                           ["--max-num-seqs", str(args.max_num_seqs),
                            "--max-num-batched-tokens", str(args.max_num_batched_tokens)],
                           ["--kv-cache-memory", args.kv_cache_memory])
    try:
        stack.wait_ready()
        run_pagedserve(stack, 4, "16:48", "8", args.seed + 1000)  # warm-up
        model = hf_baselines.load_model(model_dir)
        hf_baselines.run_static(model, warm, len(warm), pad_id)
        if "cb" not in args.skip:
            hf_baselines.run_continuous(model, warm, args.hf_cb_max_batch_tokens)
        runs = _repetitions(args, stack, model, trace, pad_id)
    finally:
        stack.stop()
    return report(args, trace, runs)


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)  # unwinds through measure()'s finally, which stops the services


def main(argv: list[str] | None = None) -> int:
    args = _settings(build_parser().parse_args(argv))
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    result = measure(args)
    print(format_table(result))
    line = json.dumps(result, sort_keys=True)
    if args.out is not None:
        args.out.write_text(line + "\n")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
