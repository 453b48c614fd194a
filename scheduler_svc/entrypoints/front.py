"""``pagedserve-front``: one front process, serving the public APIs over an engine core.

A front serves the gRPC API and the OpenAI-compatible HTTP API and does all the per-request and
per-token work: validation, tokenization and chat templates, prompt block hashing,
detokenization, stop strings and streaming (``FrontStreams``). It holds no scheduling state: its
requests run on the engine core it dials (``--core``, the tier link of ``scheduler_svc/front/core_link.py, scheduler_svc/engine/front_link.py``).

The scheduler starts ``--api-server-count`` of these itself, sharing its public ports
(SO_REUSEPORT: the kernel spreads new connections among them) and its flags; ``pagedserve-front``
runs one on its own, pointed at a scheduler's front link, so that fronts scale as a Deployment of
their own. On SIGTERM a front stops taking requests, gives those it has
``--shutdown-grace-seconds`` to finish, and exits.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import logging
import os
import signal
import socket
from dataclasses import dataclass
from pathlib import Path

import uvloop
from starlette.middleware import Middleware
from tokenizers import Tokenizer

from pagedserve.envargs import parse_with_env
from pagedserve.fd_limits import raise_open_files_limit
from pagedserve.gc_tuning import tune_gc
from pagedserve.model_dir import load_tokenizer as model_tokenizer
from pagedserve.model_dir import max_positions
from pagedserve.wire.front_messages import MAX_REQUEST_ID_CHARS
from pagedserve.wire.key_files import load_key_pair, load_public_key
from pagedserve.wire.keys import ClientKeys
from scheduler_svc.entrypoints.children import EXIT_WITH_PARENT, exit_with_parent
from scheduler_svc.entrypoints.front_ready import report_failure, report_ready
from scheduler_svc.entrypoints.service_config import ServiceConfig, load_config
from scheduler_svc.front.core_link import RemoteCore
from scheduler_svc.front.core_set import CoreSet
from scheduler_svc.front.grpc.limits import max_receive_bytes
from scheduler_svc.front.grpc.server import start_grpc_server
from scheduler_svc.front.guards.admission import CallBudget
from scheduler_svc.front.guards.auth_throttle import AuthThrottle
from scheduler_svc.front.http.app import OpenAIFront
from scheduler_svc.front.http.asgi_app import build_app
from scheduler_svc.front.http.auth import ApiKeyMiddleware
from scheduler_svc.front.http.chat_template import load_chat_template
from scheduler_svc.front.http.serve import HttpServer, start_http_server
from scheduler_svc.front.input.offload import return_large_allocations_to_the_os
from scheduler_svc.front.input.parse_pool import shared_worker
from scheduler_svc.front.streams import DUPLICATE_SUFFIX, FrontStreams
from scheduler_svc.telemetry.families import families_of
from scheduler_svc.telemetry.metrics import Metrics

log = logging.getLogger("pagedserve.front")


@dataclass(frozen=True, slots=True)
class FrontConfig:
    """What a front needs beyond the scheduler's own flags: where its core is, who it is."""

    core_endpoints: list[str]  # each engine core's front link (ipc:// from the scheduler, tcp:// from afar)
    front_id: str  # unique among the core's fronts
    reuse_port: bool  # share the public ports with the scheduler's other fronts
    keys: ClientKeys | None  # CURVE keys of a tcp:// link (None: a local or unencrypted link)


def load_tokenizer(model_dir: Path) -> Tokenizer:
    """The tokenizer of a model directory or GGUF file (pagedserve/model_dir.py); a clear exit if none."""
    try:
        return model_tokenizer(model_dir)
    except (FileNotFoundError, ValueError) as e:
        raise SystemExit(f"--model: {e}") from None


async def start_http(cfg: ServiceConfig, engine, tokenizer: Tokenizer, metrics: Metrics, budget: CallBudget,
                     throttle: AuthThrottle | None, reuse_port: bool = False,
                     metrics_text=None) -> tuple[OpenAIFront, HttpServer] | None:
    """The OpenAI-compatible API on the front's loop, unless --http-port is 0."""
    if not cfg.http_port:
        return None
    try:
        template = load_chat_template(cfg.model_dir)
    except ValueError as e:
        raise SystemExit(f"--model: {e}") from None
    if template is None:
        log.warning("%s has no chat template: /v1/chat/completions will refuse requests", cfg.model_dir)
    front = OpenAIFront(engine, tokenizer, template, cfg.limits, cfg.http_limits, metrics, cfg.tool_calls,
                        cfg.logprobs_mode, lora_updates=cfg.engine.enable_lora and cfg.engine.allow_runtime_lora_updating)
    front.metrics_text = metrics_text
    middleware = [cfg.cors.middleware()] if cfg.cors is not None else []  # (outermost: preflights carry no key)
    if cfg.api_keys is not None:  # the same keys and TLS files as the gRPC front
        middleware.append(Middleware(ApiKeyMiddleware, keys=cfg.api_keys, throttle=throttle, metrics=metrics))
    ssl = cfg.tls.uvicorn_options() if cfg.tls is not None else None
    try:
        return front, await start_http_server(build_app(front, middleware, budget), cfg.http_host, cfg.http_port,
                                              ssl, cfg.http_limits, reuse_port=reuse_port)
    except OSError as exc:  # (an ssl.SSLError is one: the TLS files)
        raise SystemExit(f"--http-port {cfg.http_port} on --http-host {cfg.http_host}: cannot serve there "
                         f"({exc})") from None


async def serve_front(cfg: ServiceConfig, fc: FrontConfig) -> None:
    tokenizer = load_tokenizer(cfg.model_dir)
    metrics = Metrics(part="front")
    # Its metrics go to the first core, which sums every front's and every core's.
    cores = [RemoteCore(e, fc.front_id, fc.keys, front_families=(lambda: families_of(metrics.registry)) if i == 0
                        else None) for i, e in enumerate(fc.core_endpoints)]
    core = CoreSet(cores, cfg.engine.max_migrations, report_core_health=bool(os.environ.get(EXIT_WITH_PARENT)))
    streams = FrontStreams(core, tokenizer, cfg.engine.stream_interval, metrics, id_prefix=fc.front_id + ":")
    core.attach(streams)
    await core.start()
    # What both APIs hold at once, and a peer's failed API keys, are counted once per front.
    budget = CallBudget.from_limits(cfg.limits)
    metrics.watch_budget(budget)
    throttle = (AuthThrottle(cfg.limits.auth_failure_burst, cfg.limits.auth_failure_refill_s)
                if cfg.api_keys is not None else None)
    http = await start_http(cfg, streams, tokenizer, metrics, budget, throttle, fc.reuse_port, core.metrics_text)
    try:
        api = await start_grpc_server(streams, tokenizer, cfg.host, cfg.port, cfg.limits, metrics,
                                      api_keys=cfg.api_keys, tls=cfg.tls, grpc_limits=cfg.grpc_limits, budget=budget,
                                      throttle=throttle, reuse_port=fc.reuse_port, logprobs_mode=cfg.logprobs_mode,
                                      max_message_bytes=max_receive_bytes(max_positions(cfg.model_dir)))
    except RuntimeError as exc:  # grpc's "Failed to bind to address" (its log line above says why)
        raise SystemExit(f"--port {cfg.port} on --host {cfg.host}: cannot serve there ({exc})") from None
    parser = shared_worker()
    await parser.start()  # now, not on the first large request: its memory is there from the start
    loop = asyncio.get_running_loop()
    for c in cores:
        c.on_status_change = lambda: loop.create_task(api.update_health())
    tune_gc()
    log.info("front %s ready: gRPC :%d, HTTP :%s, engine cores %s", fc.front_id, api.port,
             http[1].port if http else "off", ", ".join(fc.core_endpoints))
    report_ready()  # (to the scheduler that started it, if one did)

    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("front %s shutting down: refusing new requests, %.0fs grace for in-flight ones", fc.front_id,
             cfg.shutdown_grace_seconds)
    await api.begin_shutdown()
    if http:
        http[0].shutting_down = True  # new HTTP requests: 503; running streams continue
    await streams.shutdown(cfg.shutdown_grace_seconds)
    await api.stop(1.0)
    if http:
        await http[1].stop(1.0)
    await core.close()
    await parser.close()
    log.info("front %s stopped", fc.front_id)


def parse_front_args(argv: list[str] | None) -> tuple[ServiceConfig, FrontConfig]:
    """The front's own flags; the rest are the scheduler's (the same parser: a front started by the
    scheduler gets the scheduler's own command line)."""
    p = argparse.ArgumentParser(prog="pagedserve-front", add_help=False)
    p.add_argument("--core", dest="core_endpoints", action="append", default=None,
                   help="an engine core's front link: tcp://HOST:5600 (the scheduler's --front-link-port; with "
                        "--engine-cores M, give each core's: ports 5600, 5601, ...); the first sums the metrics")
    p.add_argument("--front-id", default=None, help="unique among the core's fronts (default: host name and pid)")
    p.add_argument("--reuse-port", action="store_true",
                   help="share the public ports with other fronts of this host (SO_REUSEPORT)")
    p.add_argument("--curve-key-file", type=Path, default=None,
                   help="this front's own CURVE key pair (`pagedserve keys front`); the scheduler admits its "
                        "public key (--trusted-front-keys)")
    p.add_argument("--scheduler-public-key-file", type=Path, default=None,
                   help="the scheduler's CURVE public key (its NAME.key)")
    own, rest = p.parse_known_args(argv)
    env = parse_with_env(p, [], None)  # PAGEDSERVE_FRONT_ID and friends, where not given
    for name in ("front_id", "curve_key_file", "scheduler_public_key_file"):
        if getattr(own, name) is None:
            setattr(own, name, getattr(env, name))
    if own.core_endpoints is None:  # PAGEDSERVE_CORE: one endpoint, or several separated by commas
        own.core_endpoints = [e for e in (os.environ.get("PAGEDSERVE_CORE") or "").split(",") if e]
    if not own.core_endpoints:
        p.error("--core: give the engine core's front link (tcp://HOST:5600)")
    cfg = load_config(rest)
    keys = None
    if (own.curve_key_file is None) != (own.scheduler_public_key_file is None):
        p.error("--curve-key-file and --scheduler-public-key-file go together")
    if own.curve_key_file is not None:
        try:
            pair = load_key_pair(own.curve_key_file, "--curve-key-file")
            keys = ClientKeys(pair, load_public_key(own.scheduler_public_key_file, "--scheduler-public-key-file"))
        except ValueError as exc:
            p.error(str(exc))
    front_id = own.front_id or f"{socket.gethostname()}-{os.getpid()}"
    # The core's id of a request is "<front id>:<client's id>[-suffix]" (streams.py); past the link's
    # bound the core would refuse the request's Abort and drop this front, every request it holds.
    if len(front_id) + 1 + cfg.limits.max_request_id_len + DUPLICATE_SUFFIX > MAX_REQUEST_ID_CHARS:
        p.error(f"--front-id and --max-request-id-len: the engine core takes request ids of at most "
                f"{MAX_REQUEST_ID_CHARS} characters: the front's id ({len(front_id)} characters), ':', a client's "
                f"of up to --max-request-id-len ({cfg.limits.max_request_id_len}) and '-' with "
                f"{DUPLICATE_SUFFIX - 1} hex digits for one repeated while in flight; shorten either")
    return cfg, FrontConfig(own.core_endpoints, front_id,
                            own.reuse_port or bool(os.environ.get(EXIT_WITH_PARENT)), keys)



def main(argv: list[str] | None = None) -> None:
    exit_with_parent()
    faulthandler.enable()  # a fatal signal (SIGSEGV, SIGABRT) prints every thread's traceback
    try:
        cfg, fc = parse_front_args(argv)
        return_large_allocations_to_the_os()  # request messages of megabytes must not stay in RSS
        logging.basicConfig(level=cfg.log_level, format=f"%(asctime)s %(levelname)s front {fc.front_id} %(name)s: "
                                                        f"%(message)s")
        raise_open_files_limit()  # before any socket: each client connection holds a descriptor
        uvloop.run(serve_front(cfg, fc))
    except BaseException as exc:
        report_failure(exc)  # before it was ready: the scheduler stops, saying why (after: nothing)
        raise


if __name__ == "__main__":
    main()
