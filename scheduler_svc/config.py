"""The scheduler service's configuration: flags, environment, validation.

Built once in ``__main__`` and frozen. Values learned at run time (how many
blocks an executor has, the model's max length) arrive through the executor
handshake, never by mutating this object.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from pagedserve.envargs import number, parse_with_env

DEFAULT_GRPC_PORT = 50051
DEFAULT_EXECUTOR_PORT = 5556
DEFAULT_METRICS_PORT = 9100
PORT = number(int, "port", 0, low_inclusive=True, high=65535)  # 0: pick a free port / disable


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    model_dir: Path
    host: str
    port: int
    executor_host: str
    executor_port: int
    metrics_port: int  # 0 = no metrics endpoint
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_queued_requests: int
    preemption_mode: str
    enable_prefix_caching: bool
    shutdown_grace_seconds: float
    heartbeat_interval_s: float
    max_migrations: int
    max_n: int
    max_beam_width: int
    max_logprobs: int
    log_level: str


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pagedserve-scheduler",
        description="pagedserve scheduler: the gRPC API, request queues, KV block tables and "
                    "preemption; executors dial in over ZeroMQ. Every flag also reads "
                    "PAGEDSERVE_<FLAG> from the environment.")
    p.add_argument("--model", required=True, type=Path,
                   help="model directory (config.json and tokenizer.json are read; no weights)")
    p.add_argument("--host", default="0.0.0.0", help="gRPC listen address")
    p.add_argument("--port", type=PORT, default=DEFAULT_GRPC_PORT, help="gRPC port")
    p.add_argument("--executor-host", default="0.0.0.0", help="address executors dial in to")
    p.add_argument("--executor-port", type=PORT, default=DEFAULT_EXECUTOR_PORT,
                   help="ZeroMQ ROUTER port executors dial in to")
    p.add_argument("--metrics-port", type=PORT, default=DEFAULT_METRICS_PORT,
                   help="Prometheus /metrics HTTP port (0 disables)")
    p.add_argument("--block-size", type=int, choices=(8, 16, 32), default=16,
                   help="tokens per KV block (executors must agree)")
    p.add_argument("--max-num-seqs", type=number(int, "--max-num-seqs", 0), default=256,
                   help="sequences per iteration per executor")
    p.add_argument("--max-num-batched-tokens", type=number(int, "--max-num-batched-tokens", 0),
                   default=2048, help="tokens per iteration per executor (chunked prefill budget)")
    p.add_argument("--max-queued-requests", type=number(int, "--max-queued-requests", 0), default=1024,
                   help="waiting requests beyond which new ones get RESOURCE_EXHAUSTED")
    p.add_argument("--preemption-mode", choices=("recompute", "swap"), default="recompute",
                   help="what to do with a preempted request's KV blocks")
    p.add_argument("--disable-prefix-caching", action="store_true",
                   help="do not reuse KV blocks across requests with a common prefix")
    p.add_argument("--shutdown-grace-seconds", type=number(float, "--shutdown-grace-seconds", 0, True),
                   default=30.0,
                   help="on SIGTERM, time in-flight requests get to finish before they are aborted")
    p.add_argument("--heartbeat-interval", type=number(float, "--heartbeat-interval", 0), default=1.0,
                   help="seconds between heartbeats; a peer silent for 5 intervals is dead")
    p.add_argument("--max-migrations", type=number(int, "--max-migrations", 0, True), default=3,
                   help="times a request may move to another executor after a failure")
    p.add_argument("--max-n", type=number(int, "--max-n", 0), default=16,
                   help="largest n (parallel samples) a request may ask for")
    p.add_argument("--max-beam-width", type=number(int, "--max-beam-width", 0), default=8,
                   help="largest beam_width a request may ask for")
    p.add_argument("--max-logprobs", type=number(int, "--max-logprobs", 0, True), default=20,
                   help="largest number of top logprobs a request may ask for")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def load_config(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> ServiceConfig:
    parser = build_arg_parser()
    a = parse_with_env(parser, argv, environ)
    if not (a.model / "config.json").is_file():
        parser.error(f"--model: {a.model} has no config.json")
    return ServiceConfig(
        model_dir=a.model, host=a.host, port=a.port, executor_host=a.executor_host,
        executor_port=a.executor_port, metrics_port=a.metrics_port, block_size=a.block_size,
        max_num_seqs=a.max_num_seqs, max_num_batched_tokens=a.max_num_batched_tokens,
        max_queued_requests=a.max_queued_requests, preemption_mode=a.preemption_mode,
        enable_prefix_caching=not a.disable_prefix_caching,
        shutdown_grace_seconds=a.shutdown_grace_seconds, heartbeat_interval_s=a.heartbeat_interval,
        max_migrations=a.max_migrations, max_n=a.max_n, max_beam_width=a.max_beam_width,
        max_logprobs=a.max_logprobs, log_level=a.log_level,
    )
