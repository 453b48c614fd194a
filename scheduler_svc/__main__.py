"""``pagedserve-scheduler`` / ``python -m scheduler_svc``: the scheduler service.

This process is the engine core: it owns the executors (their ZeroMQ port), the schedulers, the
KV block tables and every plan, and serves ``/metrics`` (its gauges and its fronts' counters). The
public APIs are served by ``--api-server-count`` front processes it starts (``front_process.py``),
which share the gRPC and HTTP ports and do all the per-request and per-token work; they reach the
core over a local front link (an ``ipc://`` socket in a directory only this user can enter), and
fronts of their own Deployment over ``--front-link-port``. The core's loop does nothing a request's
size or text can stretch (docs/ARCHITECTURE.md, "Serving tier").

Until SIGTERM or SIGINT: then readiness goes NOT_SERVING, the fronts refuse new requests and give
in-flight ones ``--shutdown-grace-seconds`` to finish, the rest are aborted and every block is
freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import uvloop
from prometheus_client import generate_latest

from pagedserve.wire.fingerprint import model_fingerprint
from scheduler_svc.config import ServiceConfig, load_config
from scheduler_svc.engine_core import EngineCore
from scheduler_svc.front_processes import FrontProcesses, fixed_port
from scheduler_svc.gc_tuning import tune_gc
from scheduler_svc.metrics import Metrics, start_metrics_server
from scheduler_svc.tier.core_link import FrontLink
from scheduler_svc.tier.metrics import FamiliesCollector, merge_families

log = logging.getLogger("pagedserve.scheduler")


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


async def serve(cfg: ServiceConfig, argv: list[str]) -> None:
    metrics = Metrics(part="engine")
    engine_cfg = dataclasses.replace(cfg.engine, model_fingerprint=served_model(cfg.model_dir))
    core = EngineCore(engine_cfg, eos_token_ids(cfg.model_dir), metrics)
    await core.start()
    runtime = Path(tempfile.mkdtemp(prefix="pagedserve-"))  # 0700: only this user reaches the local link
    links = [FrontLink(core, f"ipc://{runtime}/fronts", exposition=lambda: exposition())]
    if cfg.front_link_port:  # fronts of their own Deployment (CURVE with keys, as executors)
        keys = cfg.engine.executor_link.server if cfg.engine.executor_link is not None else None
        links.append(FrontLink(core, f"tcp://{cfg.front_link_host}:{cfg.front_link_port}", keys, lambda: exposition(),
                               cfg.trusted_front_keys))
    metrics.registry.register(FamiliesCollector(lambda: merge_families(link.front_families() for link in links)))

    def exposition() -> str:
        return generate_latest(metrics.registry).decode()

    for link in links:
        await link.start()
    core.on_readiness_change = lambda: [link.broadcast_status() for link in links]
    metrics_server = (start_metrics_server(cfg.metrics_port, metrics.registry, host=cfg.metrics_host)
                      if cfg.metrics_port else None)
    # The fronts bind the same ports (a port 0 is fixed here, once for all of them).
    ports = ["--port", str(fixed_port(cfg.host, cfg.port))]
    if cfg.http_port:
        ports += ["--http-port", str(fixed_port(cfg.http_host, cfg.http_port))]
    fronts = FrontProcesses([*argv, *ports], cfg.api_server_count, links[0].endpoint,
                            on_exit=lambda front_id, why: links[0].drop_front(front_id, why))
    fronts.start()
    watcher = asyncio.create_task(fronts.watch(), name="fronts")
    tune_gc()
    log.info("scheduler ready: %d fronts on gRPC :%s, HTTP :%s; executors dial %s (port %d); metrics :%s; "
             "front link %s", cfg.api_server_count, ports[1], ports[3] if cfg.http_port else "off",
             cfg.engine.executor_endpoint, core.hub.bound_port, cfg.metrics_port or "off",
             ", ".join(link.endpoint for link in links))

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("shutting down: refusing new requests, %.0fs grace for in-flight ones",
             cfg.shutdown_grace_seconds)
    core.begin_shutdown()
    await fronts.stop(cfg.shutdown_grace_seconds + 10.0)  # each front drains its own requests
    watcher.cancel()
    await core.stop()
    for link in links:
        await link.close()
    if metrics_server:
        metrics_server.close()
    shutil.rmtree(runtime, ignore_errors=True)
    log.info("scheduler stopped")


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = load_config(argv)
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    uvloop.run(serve(cfg, argv))  # a faster event loop: the core's loop runs every executor's


if __name__ == "__main__":
    main()
