"""``pagedserve-scheduler`` / ``python -m scheduler_svc``: the scheduler service.

Wires the frozen config, the engine (which binds the executors' ZeroMQ
port), the gRPC API, the OpenAI-compatible HTTP API (same loop, same engine)
and the metrics endpoint, then serves until SIGTERM or SIGINT: readiness goes
NOT_SERVING, new requests are refused on both APIs, in-flight ones get
``--shutdown-grace-seconds`` to finish, the rest are aborted and every block
is freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import signal
from pathlib import Path

import uvloop
from starlette.middleware import Middleware
from tokenizers import Tokenizer

from pagedserve.wire.fingerprint import model_fingerprint
from scheduler_svc.admission import CallBudget
from scheduler_svc.auth_throttle import AuthThrottle
from scheduler_svc.config import ServiceConfig, load_config
from scheduler_svc.engine import Engine
from scheduler_svc.gc_tuning import tune_gc
from scheduler_svc.http.app import OpenAIFront, build_app
from scheduler_svc.http.auth import ApiKeyMiddleware
from scheduler_svc.http.chat_template import load_chat_template
from scheduler_svc.http.serve import HttpServer, start_http_server
from scheduler_svc.metrics import Metrics, start_metrics_server
from scheduler_svc.offload import return_large_allocations_to_the_os
from scheduler_svc.server import start_grpc_server

log = logging.getLogger("pagedserve.scheduler")


def load_tokenizer(model_dir: Path) -> Tokenizer:
    path = model_dir / "tokenizer.json"
    if not path.is_file():
        raise SystemExit(f"--model: {model_dir} has no tokenizer.json (needed to tokenize prompts)")
    return Tokenizer.from_file(str(path))


def eos_token_ids(model_dir: Path) -> tuple[int, ...]:
    """Every end-of-sequence id the model declares, config.json's first.

    ``eos_token_id`` may be an int or a list in config.json and in
    generation_config.json (Llama 3.1 Instruct lists <|end_of_text|>, <|eom_id|> and
    <|eot_id|> there, and a chat turn ends with the last): generation stops at any.
    """
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        if not path.is_file():
            continue
        value = json.loads(path.read_text()).get("eos_token_id")
        for tok in value if isinstance(value, list) else [value]:
            if isinstance(tok, int) and not isinstance(tok, bool) and tok >= 0 and tok not in ids:
                ids.append(tok)
    return tuple(ids)


def served_model(model_dir: Path) -> str | None:
    """The fingerprint executors must present, when --model holds the weights (else the first
    executor's is taken, with a warning)."""
    try:
        return model_fingerprint(model_dir)
    except (OSError, ValueError, KeyError) as exc:
        log.warning("cannot fingerprint %s (%s): the first executor to register fixes the served model",
                    model_dir, exc)
        return None


async def start_http(cfg: ServiceConfig, engine: Engine, tokenizer: Tokenizer, metrics: Metrics, budget: CallBudget,
                     throttle: AuthThrottle | None) -> tuple[OpenAIFront, HttpServer] | None:
    """The OpenAI-compatible API on the engine's loop, unless --http-port is 0."""
    if not cfg.http_port:
        return None
    try:
        template = load_chat_template(cfg.model_dir)
    except ValueError as e:
        raise SystemExit(f"--model: {e}") from None
    if template is None:
        log.warning("%s has no chat template: /v1/chat/completions will refuse requests", cfg.model_dir)
    front = OpenAIFront(engine, tokenizer, template, cfg.limits, cfg.http_limits, metrics)
    middleware = []
    if cfg.api_keys is not None:  # the same keys and TLS files as the gRPC front
        middleware.append(Middleware(ApiKeyMiddleware, keys=cfg.api_keys, throttle=throttle, metrics=metrics))
    ssl = cfg.tls.uvicorn_options() if cfg.tls is not None else None
    return front, await start_http_server(build_app(front, middleware, budget), cfg.http_host, cfg.http_port, ssl,
                                          cfg.http_limits)


async def serve(cfg: ServiceConfig) -> None:
    tokenizer = load_tokenizer(cfg.model_dir)
    metrics = Metrics()
    engine_cfg = dataclasses.replace(cfg.engine, model_fingerprint=served_model(cfg.model_dir))
    engine = Engine(engine_cfg, tokenizer, eos_token_ids(cfg.model_dir), metrics)
    await engine.start()
    # What both fronts hold at once, and a peer's failed API keys, are counted once per process.
    budget = CallBudget.from_limits(cfg.limits)
    metrics.watch_budget(budget)
    throttle = (AuthThrottle(cfg.limits.auth_failure_burst, cfg.limits.auth_failure_refill_s)
                if cfg.api_keys is not None else None)
    log.info("at most %d calls and %d MiB of request bytes in progress (--max-concurrent-calls, "
             "--max-in-flight-bytes)", budget.max_calls, budget.max_bytes >> 20)
    http = await start_http(cfg, engine, tokenizer, metrics, budget, throttle)  # first: gRPC liveness implies HTTP
    api = await start_grpc_server(engine, tokenizer, cfg.host, cfg.port, cfg.limits, metrics,
                                  api_keys=cfg.api_keys, tls=cfg.tls, grpc_limits=cfg.grpc_limits, budget=budget,
                                  throttle=throttle)
    loop = asyncio.get_running_loop()
    engine.on_readiness_change = lambda: loop.create_task(api.update_health())
    metrics_server = (start_metrics_server(cfg.metrics_port, metrics.registry, host=cfg.metrics_host)
                      if cfg.metrics_port else None)
    tune_gc()
    log.info("scheduler ready: gRPC :%d, HTTP :%s, executors dial %s (port %d), metrics :%s",
             api.port, http[1].port if http else "off", cfg.engine.executor_endpoint, engine.hub.bound_port,
             cfg.metrics_port or "off")

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: refusing new requests, %.0fs grace for in-flight ones",
             cfg.shutdown_grace_seconds)
    await api.begin_shutdown()
    if http:
        http[0].shutting_down = True  # new HTTP requests: 503; running streams continue
    await engine.shutdown(cfg.shutdown_grace_seconds)
    await api.stop(1.0)
    if http:
        await http[1].stop(1.0)
    if metrics_server:
        metrics_server.close()
    log.info("scheduler stopped")


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(argv)
    return_large_allocations_to_the_os()  # request messages of megabytes must not stay in RSS
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvloop.run(serve(cfg))  # a faster event loop: each step wakes every streaming request (PERF.md)


if __name__ == "__main__":
    main()
