"""An engine core of its own: the scheduler's core number k > 0 with ``--engine-cores M``.

When one scheduling process's CPU is the limit (many executors, short steps), the scheduler runs
M engine cores: itself (core 0) and M - 1 of these, each a process with its own event loop. Core
k schedules the executors the directory (core 0's executor port) sends it to, on the executor
port + k; it serves fronts on its own front link (``ipc://`` from the scheduler's fronts, and the
front link port + k for fronts of their own when ``--front-link-port`` is set). Core 0 asks it for
its stats and metrics, and sums them into the deployment's.

The scheduler starts these with its own command line and ``--core-index k --core-link ENDPOINT``,
and starts one again when it exits; the executors it had go back to the directory when it goes
silent, and its fronts move its requests to the other cores.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import faulthandler
import logging
import os
import signal
import time

import uvloop

from pagedserve.fd_limits import raise_open_files_limit
from pagedserve.gc_tuning import tune_gc
from pagedserve.model_dir import eos_token_ids, served_model
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.engine.front_link import FrontLink
from scheduler_svc.entrypoints.children import EXIT_WITH_PARENT, exit_with_parent
from scheduler_svc.entrypoints.service_config import ServiceConfig, load_config
from scheduler_svc.telemetry.families import families_of
from scheduler_svc.telemetry.metrics import Metrics

log = logging.getLogger("pagedserve.core")


def with_port(endpoint: str, offset: int) -> str:
    """``tcp://host:port`` with the port moved by ``offset`` (core k's ports are the base ports + k)."""
    head, _, port = endpoint.rpartition(":")
    return f"{head}:{int(port) + offset}"


def core_links(core: EngineCore, cfg: ServiceConfig, index: int, local: str, metrics: Metrics,
               exposition=None) -> list[FrontLink]:
    """Core ``index``'s front links: ``local`` (the scheduler's own fronts), and a TCP one for fronts of
    their own when --front-link-port is set (that port + index)."""
    def own() -> list:
        return families_of(metrics.registry)

    links = [FrontLink(core, local, exposition=exposition, own_families=own, limits=cfg.limits)]
    if cfg.front_link_port:
        keys = cfg.engine.executor_link.server if cfg.engine.executor_link is not None else None
        links.append(FrontLink(core, f"tcp://{cfg.front_link_host}:{cfg.front_link_port + index}", keys,
                               exposition, cfg.trusted_front_keys, own, limits=cfg.limits))
    return links


async def serve_core(cfg: ServiceConfig, index: int, local: str) -> None:
    metrics = Metrics(part="engine")
    engine_cfg = dataclasses.replace(cfg.engine, executor_endpoint=with_port(cfg.engine.executor_endpoint, index),
                                     model_fingerprint=served_model(cfg.model_dir))
    core = EngineCore(engine_cfg, eos_token_ids(cfg.model_dir), metrics)
    await core.start()
    links = core_links(core, cfg, index, local, metrics)
    for link in links:
        await link.start()
    core.on_readiness_change = lambda: [link.broadcast_status() for link in links]
    tune_gc()
    log.info("engine core %d ready: executors on %s (port %d), front links %s", index,
             engine_cfg.executor_endpoint, core.hub.bound_port, ", ".join(link.endpoint for link in links))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    core.begin_shutdown()
    deadline = time.monotonic() + cfg.shutdown_grace_seconds  # (the fronts end their requests meanwhile)
    while core.requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await core.stop()
    for link in links:
        await link.close()
    log.info("engine core %d stopped", index)


def main(argv: list[str] | None = None) -> None:
    exit_with_parent()
    faulthandler.enable()  # a fatal signal (SIGSEGV, SIGABRT) prints every thread's traceback
    p = argparse.ArgumentParser(prog="python -m scheduler_svc.entrypoints.core", add_help=False)
    p.add_argument("--core-index", type=int, required=True)
    p.add_argument("--core-link", required=True)
    own, rest = p.parse_known_args(argv)
    cfg = load_config(rest)
    logging.basicConfig(level=cfg.log_level, format=f"%(asctime)s %(levelname)s core {own.core_index} "
                                                    f"%(name)s: %(message)s")
    raise_open_files_limit()
    if not os.environ.get(EXIT_WITH_PARENT):
        log.warning("an engine core is started by pagedserve-scheduler --engine-cores, not by hand")
    uvloop.run(serve_core(cfg, own.core_index, own.core_link))


if __name__ == "__main__":
    main()
