"""``pagedserve-scheduler`` / ``python -m scheduler_svc``: the scheduler service.

This process is the engine core: it owns the executors (their ZeroMQ port), the schedulers, the
KV block tables and every plan, and serves ``/metrics`` (its gauges and its fronts' counters). The
public APIs are served by ``--api-server-count`` front processes it starts (``front_process.py``),
which share the gRPC and HTTP ports and do all the per-request and per-token work; they reach the
core over a local front link (an ``ipc://`` socket in a directory only this user can enter), and
fronts of their own Deployment over ``--front-link-port``. The core's loop does nothing a request's
size or text can stretch (docs/ARCHITECTURE.md, "Serving tier").

Until SIGTERM or SIGINT: then readiness goes NOT_SERVING, the fronts reject new requests and give
in-flight ones ``--shutdown-grace-seconds`` to finish, the rest are aborted and every block is
freed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import faulthandler
import logging
import shutil
import signal
import sys
import tempfile
from pathlib import Path

import uvloop
import zmq
from prometheus_client import CollectorRegistry

from pagedserve.fd_limits import raise_open_files_limit
from pagedserve.gc_tuning import tune_gc
from pagedserve.model_dir import eos_token_ids, served_model
from pagedserve.port_claim import PortUnavailable, claim_port
from scheduler_svc.engine.core import EngineCore
from scheduler_svc.entrypoints.children import Children
from scheduler_svc.entrypoints.core import core_links
from scheduler_svc.entrypoints.other_cores import OtherCores
from scheduler_svc.entrypoints.service_config import ServiceConfig, load_config
from scheduler_svc.telemetry.families import FamiliesCollector, families_of, merge_families, with_vllm_names
from scheduler_svc.telemetry.metrics import Metrics
from scheduler_svc.telemetry.metrics_server import EXPOSITION_TTL_S, CachedExposition, start_metrics_server

log = logging.getLogger("pagedserve.scheduler")


async def serve(cfg: ServiceConfig, argv: list[str], public: PublicPorts) -> None:
    metrics = Metrics(part="engine")
    engine_cfg = dataclasses.replace(cfg.engine, model_fingerprint=served_model(cfg.model_dir))
    core = EngineCore(engine_cfg, eos_token_ids(cfg.model_dir), metrics)
    try:
        await core.start()
    except zmq.ZMQError as exc:  # (claimed free in main: taken since)
        raise SystemExit(f"pagedserve-scheduler: --executor-port: cannot listen on {cfg.engine.executor_endpoint} "
                         f"({exc})") from None
    # 0700: only this user reaches the local links. (An ipc:// path must fit a socket address, 107 bytes.)
    runtime = Path(tempfile.mkdtemp(prefix="pagedserve-", dir=None if len(tempfile.gettempdir()) < 60 else "/tmp"))
    local = [f"ipc://{runtime}/core-{k}" for k in range(cfg.engine_cores)]  # each engine core's, for the fronts

    # What /metrics shows: this core's metrics, its fronts' and the other cores', summed (one family
    # per name; the vllm: gauges are this core's, computed from every core's stats), and the sums
    # vLLM's dashboards read copied under vLLM's names.
    deployment = CollectorRegistry()
    deployment.register(FamiliesCollector(lambda: with_vllm_names(merge_families(
        [families_of(metrics.registry), *(link.front_families() for link in links), others.families()]),
        metrics.model_name)))

    # Rendered at most every EXPOSITION_TTL_S however many fronts (and their scrapers: the inference
    # gateway's picker polls each every 100 ms) and --metrics-port scrapers ask.
    exposition = CachedExposition(deployment, EXPOSITION_TTL_S, asyncio.get_running_loop())
    links = core_links(core, cfg, 0, local[0], metrics, lambda: exposition().decode())
    others = OtherCores(core, local[1:], core.hub.bound_port)
    if cfg.engine_cores > 1:  # this executor port is the directory; each core schedules on its own
        core.hub.director = others.director
        core.deployment_stats = others.deployment_stats
    for link in links:
        await link.start()
    core.on_readiness_change = lambda: [link.broadcast_status() for link in links]
    metrics_server = start_metrics(cfg, public.metrics, exposition) if public.metrics else None
    cores = Children("scheduler_svc.entrypoints.core", cfg.engine_cores - 1, name=lambda c: f"engine core {c.index + 1}",
                     args=lambda c: [*argv, "--core-index", str(c.index + 1), "--core-link", local[c.index + 1]],
                     on_exit=lambda name, why: None)  # (its executors and fronts see it go silent)
    cores.start()
    await others.start()
    # The fronts bind the same ports (claimed in main: free, a port 0 fixed once for all of them).
    ports = ["--port", str(public.grpc)]
    if public.http:
        ports += ["--http-port", str(public.http)]
    to_cores = [arg for endpoint in local for arg in ("--core", endpoint)]
    fronts = Children("scheduler_svc.entrypoints.front", cfg.api_server_count, name=lambda c: f"local-{c.index}.{c.generation}",
                      args=lambda c: [*argv, *ports, *to_cores, "--front-id", c.name],
                      on_exit=lambda front_id, why: links[0].drop_front(front_id, why), ready_pipes=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    fronts.start()
    watchers = [asyncio.create_task(children.watch(), name=children.module) for children in (cores, fronts)]
    # Ready once every front serves; a front that cannot start (every restart would fail alike) stops it all.
    ready, stopped = asyncio.create_task(fronts.wait_ready()), asyncio.create_task(stop.wait())
    await asyncio.wait([ready, stopped], return_when=asyncio.FIRST_COMPLETED)
    failure = ready.result() if ready.done() else None
    if ready.done() and failure is None:
        tune_gc()
        log.info("scheduler ready: %d fronts on gRPC :%s, HTTP :%s; %d engine cores; executors dial %s (port %d); "
                 "metrics :%s; front link %s", cfg.api_server_count, ports[1], ports[3] if cfg.http_port else "off",
                 cfg.engine_cores, cfg.engine.executor_endpoint, core.hub.bound_port, public.metrics or "off",
                 ", ".join(link.endpoint for link in links))
        await stop.wait()
    ready.cancel()
    stopped.cancel()
    if failure is None:
        log.info("shutting down: refusing new requests, %.0fs grace for in-flight ones",
                 cfg.shutdown_grace_seconds)
    core.begin_shutdown()
    await fronts.stop(cfg.shutdown_grace_seconds + 10.0)  # each front drains its own requests
    await cores.stop(10.0)
    for w in watchers:
        w.cancel()
    await others.close()
    await core.stop()
    for link in links:
        await link.close()
    if metrics_server:
        metrics_server.close()
    shutil.rmtree(runtime, ignore_errors=True)
    log.info("scheduler stopped")
    if failure is not None:
        raise SystemExit(f"pagedserve-scheduler: {failure}")


@dataclasses.dataclass(frozen=True, slots=True)
class PublicPorts:
    grpc: int
    http: int  # 0: no HTTP API
    metrics: int  # 0: no /metrics


def claim_ports(cfg: ServiceConfig) -> PublicPorts:
    """Each public port checked free of any other program (the fronts' SO_REUSEPORT would share it
    silently: pagedserve/port_claim.py), a port 0 fixed; before anything starts. The engine cores'
    executor and front-link ports too (core k: + k), which would otherwise fail in ZeroMQ's bind, in
    core 0 as a traceback and in the others as a restart loop."""
    executor_host, executor_port = cfg.engine.executor_endpoint[len("tcp://"):].rsplit(":", 1)
    for k in range(cfg.engine_cores):
        if int(executor_port):
            claim_port(executor_host, int(executor_port) + k, "--executor-host", "--executor-port")
        if cfg.front_link_port:
            claim_port(cfg.front_link_host, cfg.front_link_port + k, "--front-link-host", "--front-link-port")
    return PublicPorts(claim_port(cfg.host, cfg.port, "--host", "--port"),
                       claim_port(cfg.http_host, cfg.http_port, "--http-host", "--http-port") if cfg.http_port else 0,
                       claim_port(cfg.metrics_host, cfg.metrics_port, "--metrics-host", "--metrics-port")
                       if cfg.metrics_port else 0)


def start_metrics(cfg: ServiceConfig, port: int, exposition: CachedExposition):
    """/metrics on the claimed port (another program may have taken it since: say so, naming the flag)."""
    try:
        return start_metrics_server(port, exposition, host=cfg.metrics_host)
    except OSError as exc:
        raise SystemExit(f"pagedserve-scheduler: --metrics-port {port}: cannot listen on {cfg.metrics_host} "
                         f"({exc.strerror or exc})") from None


def main(argv: list[str] | None = None) -> None:
    faulthandler.enable()  # a fatal signal (SIGSEGV, SIGABRT) prints every thread's traceback
    argv = list(sys.argv[1:] if argv is None else argv)
    cfg = load_config(argv)
    logging.basicConfig(level=cfg.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise_open_files_limit()  # before any socket: each client connection holds a descriptor
    try:
        public = claim_ports(cfg)
    except PortUnavailable as exc:
        raise SystemExit(f"pagedserve-scheduler: {exc}") from None
    uvloop.run(serve(cfg, argv, public))  # a faster event loop: the core's loop runs every executor's


if __name__ == "__main__":
    main()
