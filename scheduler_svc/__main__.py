"""``pagedserve-scheduler`` / ``python -m scheduler_svc``: the scheduler service.

Wires the frozen config, the engine (which binds the executors' ZeroMQ
port), the gRPC API and the metrics endpoint, then serves until SIGTERM or
SIGINT: readiness goes NOT_SERVING, new requests are refused, in-flight ones
get ``--shutdown-grace-seconds`` to finish, the rest are aborted and every
block is freed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal

from tokenizers import Tokenizer

from scheduler_svc.config import ServiceConfig, load_config
from scheduler_svc.engine import Engine, tune_gc
from scheduler_svc.metrics import Metrics, start_metrics_server
from scheduler_svc.server import start_grpc_server

log = logging.getLogger("pagedserve.scheduler")


def _load_model_side(cfg: ServiceConfig) -> tuple[Tokenizer, int | None, str, str]:
    """The tokenizer and the few config.json facts the scheduler needs (no weights)."""
    tok_path = cfg.model_dir / "tokenizer.json"
    if not tok_path.is_file():
        raise SystemExit(f"--model: {cfg.model_dir} has no tokenizer.json (needed to tokenize prompts)")
    tokenizer = Tokenizer.from_file(str(tok_path))
    hf = json.loads((cfg.model_dir / "config.json").read_text())
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):  # Llama 3 lists several; the first is the canonical end of text
        eos = eos[0] if eos else None
    arch = (hf.get("architectures") or ["unknown"])[0]
    return tokenizer, eos, cfg.model_dir.name, arch


async def serve(cfg: ServiceConfig) -> None:
    tokenizer, eos, name, arch = _load_model_side(cfg)
    metrics = Metrics()
    engine = Engine(cfg.engine, tokenizer, eos, metrics)
    await engine.start()
    api = await start_grpc_server(engine, tokenizer, cfg.host, cfg.port, cfg.limits, metrics)
    loop = asyncio.get_running_loop()
    engine.on_readiness_change = lambda: loop.create_task(api.update_health())
    metrics_server = start_metrics_server(cfg.metrics_port, metrics.registry) if cfg.metrics_port else None
    tune_gc()
    log.info("scheduler ready: gRPC :%d, executors dial %s (port %d), metrics :%s",
             api.port, cfg.engine.executor_endpoint, engine.hub.bound_port, cfg.metrics_port or "off")

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: refusing new requests, %.0fs grace for in-flight ones",
             cfg.shutdown_grace_seconds)
    await api.begin_shutdown()
    await engine.shutdown(cfg.shutdown_grace_seconds)
    await api.stop(1.0)
    if metrics_server:
        metrics_server.close()
    log.info("scheduler stopped")


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(argv)
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(serve(cfg))


if __name__ == "__main__":
    main()
