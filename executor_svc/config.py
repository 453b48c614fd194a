"""The executor process's configuration: flags, environment, validation.

Built once in ``__main__`` and frozen. Every flag also reads
``PAGEDSERVE_<FLAG>`` from the environment (the command line wins); this is
the only place the executor reads the environment. Values learned at run time
(how many KV blocks fit) go into the handshake, never back into this object.
"""

from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from pagedserve import wire
from pagedserve.envargs import number, parse_bytes, parse_with_env

DTYPES = ("auto", "float32", "float16", "bfloat16")
CPU_ATTENTION = ("auto", "fused", "torch")  # --cpu-attention; executor_svc/backends.py acts on it
DEVICES = ("cpu", "cuda")


@dataclass(frozen=True, slots=True)
class ExecutorConfig:
    model_dir: Path
    scheduler: str  # ZeroMQ endpoint of the scheduler's ROUTER, e.g. tcp://host:5556
    device: str
    kv_cache_memory: int  # bytes for the device block pools on CPU
    gpu_memory_utilization: float  # fraction of GPU memory this process may use (CUDA)
    swap_space: int  # bytes for the CPU swap pool
    block_size: int
    dtype: str
    cpu_attention: str  # auto | fused | torch (executor_svc/backends.py, make_attention_backend)
    executor_id: str
    health_port: int  # 0 = no health server
    drain_timeout: float  # seconds to keep serving after SIGTERM
    cluster_secret_file: Path | None  # CURVE keys of the link to the scheduler (None: unencrypted)
    log_level: str


def _endpoint(text: str) -> str:
    if not text.startswith(("tcp://", "ipc://", "inproc://")):
        raise argparse.ArgumentTypeError(f"--scheduler: expected tcp://HOST:PORT, got {text!r}")
    return text


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedserve-executor",
        description="Run a Llama-family model on a paged KV cache for a pagedserve scheduler. "
                    "Every flag also reads PAGEDSERVE_<FLAG> from the environment.")
    p.add_argument("--model", required=True, help="HF model directory (config.json, *.safetensors)")
    p.add_argument("--scheduler", required=True, type=_endpoint, help="scheduler endpoint, tcp://HOST:5556")
    p.add_argument("--device", choices=DEVICES, default="cpu")
    p.add_argument("--kv-cache-memory", type=parse_bytes, default=parse_bytes("2GiB"),
                   help="KV cache size on CPU (e.g. 2GiB)")
    p.add_argument("--gpu-memory-utilization", type=number(float, "--gpu-memory-utilization", 0.0, high=1.0),
                   default=0.9, help="fraction of GPU memory for weights + KV cache (CUDA)")
    p.add_argument("--swap-space", type=parse_bytes, default=parse_bytes("4GiB"),
                   help="CPU swap pool size (e.g. 4GiB; 0 disables swapping)")
    p.add_argument("--block-size", type=int, choices=wire.BLOCK_SIZES, default=wire.DEFAULT_BLOCK_SIZE,
                   help="tokens per KV block; must match the scheduler's")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="compute dtype; auto = float32 on CPU, the checkpoint's on CUDA")
    p.add_argument("--cpu-attention", choices=CPU_ATTENTION, default="auto",
                   help="CPU decode attention: fused = the C kernel (executor_svc/csrc), torch = gather + "
                        "SDPA; auto = fused when it compiles, else torch with a warning")
    p.add_argument("--executor-id", default=None, help="name in the scheduler's registry (default HOST-PID)")
    p.add_argument("--health-port", type=number(int, "--health-port", 0, low_inclusive=True, high=65535),
                   default=8090, help="grpc.health.v1 port (0 disables)")
    p.add_argument("--drain-timeout", type=number(float, "--drain-timeout", 0.0, low_inclusive=True),
                   default=30.0, help="seconds to keep serving plans after SIGTERM")
    p.add_argument("--cluster-secret-file", type=Path, default=None,
                   help="file holding the cluster secret the scheduler was given: the link is then "
                        "authenticated and encrypted (CurveZMQ)")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def parse_config(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> ExecutorConfig:
    args = parse_with_env(build_arg_parser(), argv, environ)
    return ExecutorConfig(
        model_dir=Path(args.model), scheduler=args.scheduler, device=args.device,
        kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
        swap_space=args.swap_space, block_size=args.block_size, dtype=args.dtype,
        cpu_attention=args.cpu_attention,
        executor_id=args.executor_id or f"{socket.gethostname()}-{os.getpid()}",
        health_port=args.health_port, drain_timeout=args.drain_timeout,
        cluster_secret_file=args.cluster_secret_file, log_level=args.log_level)
