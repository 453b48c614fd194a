"""The scheduler's memory under a burst of maximum-size gRPC requests, with and without a cap.

Starts a real scheduler (``python -m scheduler_svc``, the tiny model's tokenizer, no executor: every
call ends UNAVAILABLE or RESOURCE_EXHAUSTED, after or before its message is read) and sends
``--calls`` concurrent ``Generate`` calls of a ``--prompt-mb`` MB prompt each, while sampling the
resident memory of its process and the front processes it starts every 5 ms. Prints the baseline, the peak and the
status codes; ``--scheduler-args`` go to the scheduler (e.g. ``--max-in-flight-bytes 268435456``).

    .venv/bin/python -m benchmarks.front_burst_memory [--calls 150] [--prompt-mb 3.9] [--scheduler-args "..."]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from benchmarks.proc_stat import children
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.v1 import generation_pb2_grpc as pb_grpc


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rss_mib(pid: int) -> float:
    """Resident memory of ``pid`` and its live children: the fronts that read the requests are
    processes the scheduler starts."""
    total = 0.0
    for each in (pid, *children(pid)):
        with contextlib.suppress(OSError), open(f"/proc/{each}/status") as f:  # (a child that ended meanwhile)
            total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    return total


def _sample(pid: int, stop: threading.Event, peak: list[float]) -> None:
    while not stop.is_set():
        peak[0] = max(peak[0], _rss_mib(pid))
        time.sleep(0.005)


def _wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the scheduler exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit("the scheduler did not start listening")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=150)
    p.add_argument("--prompt-mb", type=float, default=3.9)
    p.add_argument("--scheduler-args", default="")
    a = p.parse_args(argv)
    from executor_svc.tiny_model import build_tiny_model

    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_model(Path(tmp) / "model", "llama", "small")
        # A model of 262,144 positions, so gRPC reads messages up to its own 4 MiB limit (the front
        # derives its limit from max_position_embeddings: grpc/limits.max_receive_bytes).
        config = json.loads((model / "config.json").read_text())
        (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 262144}))
        port = _free_port()
        cmd = [sys.executable, "-m", "scheduler_svc", "--model", str(model), "--host", "127.0.0.1", "--port",
               str(port), "--http-port", "0", "--metrics-port", "0", "--executor-port", str(_free_port()),
               *shlex.split(a.scheduler_args)]
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=dict(os.environ))
        try:
            _wait_listening(port, proc)
            time.sleep(1.0)
            baseline, peak, stop = _rss_mib(proc.pid), [0.0], threading.Event()
            sampler = threading.Thread(target=_sample, args=(proc.pid, stop, peak), daemon=True)
            sampler.start()
            prompt = "x" * int(a.prompt_mb * 1e6)
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 8 << 20)]) as ch:
                stub = pb_grpc.GenerationStub(ch)

                def call(_: int) -> str:
                    try:
                        list(stub.Generate(pb.GenerateRequest(prompt=prompt), timeout=120))
                        return "OK"
                    except grpc.RpcError as e:
                        return e.code().name

                with ThreadPoolExecutor(a.calls) as pool:
                    codes = collections.Counter(pool.map(call, range(a.calls)))
            time.sleep(0.5)
            stop.set()
            sampler.join()
            out = {"calls": a.calls, "prompt_mb": a.prompt_mb, "scheduler_args": a.scheduler_args,
                   "baseline_mib": round(baseline), "peak_mib": round(peak[0]),
                   "peak_over_baseline_mib": round(peak[0] - baseline), "codes": dict(codes)}
            print(json.dumps(out))
        finally:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    main()
