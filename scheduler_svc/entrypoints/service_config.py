"""The scheduler service's configuration: parsed flags checked and built into a frozen ServiceConfig.

Built once in ``__main__``. The flags themselves are declared in ``service_flags.py``;
:func:`load_config` parses them (with the environment), checks what they mean together and the
files they name (model, draft, LoRA adapters, keys, TLS), and builds the configs straight from
the parsed flags (:class:`SchedulerConfig`, :class:`EngineConfig`, :class:`ServerLimits`, ...),
so nothing is copied field by field. A bad value stops the service with argparse's usage error,
saying why. Values learned at run time (how many blocks an executor has, the model's max
length) arrive through the executor handshake, never by mutating this object.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import logging
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedserve.draft_model import check_draft
from pagedserve.envargs import given_dests, parse_with_env
from pagedserve.lora_modules import (
    LoraConfigError,
    LoraModule,
    check_not_base_model,
    inspect_adapter,
    parse_lora_module,
    split_lora_modules,
)
from pagedserve.model_dir import has_model_config, is_gguf, open_gguf, resolve_model
from scheduler_svc.engine.engine_config import EngineConfig
from scheduler_svc.engine.executor_auth import LinkSecurity
from scheduler_svc.engine.link_flags import link_security
from scheduler_svc.entrypoints.service_flags import build_arg_parser
from scheduler_svc.front.grpc.limits import MAX_REQUEST_BYTES, GrpcLimits
from scheduler_svc.front.guards.admission import sized_for_machine
from scheduler_svc.front.guards.security import ApiKeys, TlsFiles
from scheduler_svc.front.http.cors import CorsOptions
from scheduler_svc.front.http.limits import HttpLimits
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.front.input.validation import LOGPROBS_MODES
from scheduler_svc.front.tool_calls import ToolCallOptions
from scheduler_svc.sched.scheduler_config import SchedulerConfig

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    model_dir: Path
    host: str
    port: int
    metrics_host: str
    metrics_port: int  # 0 = no metrics endpoint
    http_host: str
    http_port: int  # 0 = no HTTP API
    http_limits: HttpLimits  # bounds on HTTP bodies, before the shared validator
    engine: EngineConfig  # its .scheduler: the per-executor scheduling knobs
    limits: ServerLimits  # per-request limits at the API edge
    shutdown_grace_seconds: float
    log_level: str
    api_keys: ApiKeys | None = None  # the public fronts require one of these (None: open)
    tls: TlsFiles | None = None  # the public fronts serve TLS (None: plaintext)
    grpc_limits: GrpcLimits = GrpcLimits()  # how long gRPC connections and request messages may take
    api_server_count: int = 1  # front processes the scheduler starts (they share the public ports)
    engine_cores: int = 1  # scheduling processes (each schedules its own executors)
    front_link_host: str = "127.0.0.1"  # where fronts of their own Deployment dial the core
    front_link_port: int = 0  # 0: only the scheduler's own fronts (over a local ipc:// link)
    trusted_front_keys: Path | None = None  # the keys of fronts of their own (a CURVE front link)
    logprobs_mode: str = LOGPROBS_MODES[0]  # what reported log-probs describe (every executor follows it)
    tool_calls: ToolCallOptions = ToolCallOptions()  # --enable-auto-tool-choice, --tool-call-parser
    cors: CorsOptions | None = None  # --allowed-origins and the rest (None: no CORS headers)

    @property
    def scheduler(self) -> SchedulerConfig:
        return self.engine.scheduler


def _api_keys(parser: argparse.ArgumentParser, a: argparse.Namespace) -> ApiKeys | None:
    if a.api_key_file is None:
        return None
    try:
        return ApiKeys.from_file(a.api_key_file)  # (unreadable files are a ValueError too)
    except ValueError as exc:
        parser.error(str(exc))


def _tls(parser: argparse.ArgumentParser, a: argparse.Namespace) -> TlsFiles | None:
    if a.tls_cert_file is None and a.tls_key_file is None:
        if a.tls_client_ca_file is not None:
            parser.error("--tls-client-ca-file: needs --tls-cert-file and --tls-key-file")
        return None
    if a.tls_cert_file is None or a.tls_key_file is None:
        parser.error("--tls-cert-file and --tls-key-file: give both or neither")
    for flag, path in (("--tls-cert-file", a.tls_cert_file), ("--tls-key-file", a.tls_key_file),
                       ("--tls-client-ca-file", a.tls_client_ca_file)):
        if path is not None and not path.is_file():
            parser.error(f"{flag}: {path} is not a readable file")
    try:  # now, not in each front (where grpc says only "Failed to bind to address", the wrong cause)
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(a.tls_cert_file, a.tls_key_file,
                                                                password=lambda: b"")  # (never a prompt)
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            parser.error(f"--tls-key-file: {a.tls_key_file} is not the private key of the certificate in "
                         f"--tls-cert-file {a.tls_cert_file}")
        parser.error(f"--tls-cert-file {a.tls_cert_file}, --tls-key-file {a.tls_key_file}: not a PEM certificate "
                     f"and its unencrypted private key ({exc})")
    if a.tls_client_ca_file is not None:
        try:
            ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_verify_locations(cafile=a.tls_client_ca_file)
        except ssl.SSLError as exc:
            parser.error(f"--tls-client-ca-file: {a.tls_client_ca_file} holds no PEM CA certificate ({exc})")
    return TlsFiles(a.tls_cert_file, a.tls_key_file, a.tls_client_ca_file)


def _executor_link(parser: argparse.ArgumentParser, a: argparse.Namespace) -> LinkSecurity | None:
    """The executor link's keys (scheduler_svc/engine/link_flags.py): its own key pair is read once, here."""
    try:
        return link_security(a)
    except (ValueError, RuntimeError) as exc:
        parser.error(str(exc))


def _executor_host(parser: argparse.ArgumentParser, a: argparse.Namespace, keys: LinkSecurity | None) -> str:
    """Secure by default: without keys the executor port binds loopback only."""
    if keys is not None:
        return a.executor_host or "0.0.0.0"
    host = a.executor_host or "127.0.0.1"
    if not _is_loopback(host):
        if not a.allow_insecure_executors:
            parser.error(f"--executor-host {host}: executors would dial in unauthenticated and unencrypted; "
                         "give --curve-secret-key-file (or --cluster-secret-file on one machine; or, knowingly, "
                         "--allow-insecure-executors)")
        log.warning("executor link on %s WITHOUT authentication or encryption (--allow-insecure-executors): "
                    "anyone who reaches it receives prompts and can forge outputs", host)
    return host


def _check_port_ranges(parser: argparse.ArgumentParser, a: argparse.Namespace) -> None:
    """Engine core k listens on --executor-port + k and --front-link-port + k: the ranges must not
    meet each other or the public ports, and no two public ports (0 aside: off, or any free one) may be
    the same."""
    cores = range(a.engine_cores)
    executor = {a.executor_port + k for k in cores}
    front_link = {a.front_link_port + k for k in cores} if a.front_link_port else set()
    if executor & front_link:
        parser.error(f"--front-link-port: {a.front_link_port}..{a.front_link_port + a.engine_cores - 1} meets the "
                     f"engine cores' executor ports {a.executor_port}..{a.executor_port + a.engine_cores - 1} "
                     f"(--executor-port + k for --engine-cores {a.engine_cores}); move one of them")
    public = (("--port", a.port), ("--http-port", a.http_port), ("--metrics-port", a.metrics_port))
    for i, (flag, port) in enumerate(public):
        if port and port in executor | front_link:
            parser.error(f"{flag}: {port} is one of the engine cores' executor or front-link ports")
        for other, other_port in public[:i]:  # two servers on one port: every call of one of them would fail
            if port and port == other_port:
                parser.error(f"{flag}: {port} is also {other}'s port; give each its own")


def _front_link_host(parser: argparse.ArgumentParser, a: argparse.Namespace, keys: LinkSecurity | None) -> str:
    """As the executor link: without keys, fronts of their own dial in on loopback only."""
    host = a.front_link_host or ("0.0.0.0" if keys is not None else "127.0.0.1")
    if a.front_link_port and keys is not None and a.trusted_front_keys is None:
        parser.error("--front-link-port: with keys, give --trusted-front-keys (the fronts' public keys)")
    if a.trusted_front_keys is not None and not a.trusted_front_keys.exists():
        parser.error(f"--trusted-front-keys: {a.trusted_front_keys} does not exist")
    if a.front_link_port and keys is None and not _is_loopback(host) and not a.allow_insecure_executors:
        parser.error(f"--front-link-host: {host} is not loopback and the link has no keys; give "
                     "--curve-secret-key-file (or, knowingly, --allow-insecure-executors)")
    return host


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _fields(cls: type, args: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)}


def load_config(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> ServiceConfig:
    parser = build_arg_parser()
    a = parse_with_env(parser, argv, environ)
    a.model = resolve_model(a.model)
    if not has_model_config(a.model):
        parser.error(f"--model: {a.model} has no config.json (nor is it a GGUF file, or a directory holding one)")
    if is_gguf(a.model):  # a bad file stops the service here, saying why, before anything starts
        try:
            open_gguf(a.model)
        except ValueError as e:
            parser.error(f"--model: {e}")
    scheduler = SchedulerConfig(**_fields(SchedulerConfig, a))
    if scheduler.speculative is not None and scheduler.speculative.model is not None:
        try:  # a draft that cannot serve the model stops the service here, naming it
            check_draft(Path(scheduler.speculative.model), a.model)
        except ValueError as exc:
            parser.error(f"--speculative-config: {exc}")
    _fit_widths(parser, a, scheduler, given_dests(parser, argv, environ))
    a.lora_modules = _lora_modules(parser, a)
    keys = _executor_link(parser, a)
    host = _executor_host(parser, a, keys)
    _check_port_ranges(parser, a)
    try:
        engine = EngineConfig(scheduler=scheduler, executor_endpoint=f"tcp://{host}:{a.executor_port}",
                              executor_link=keys,
                              **{k: v for k, v in _fields(EngineConfig, a).items() if k != "scheduler"})
    except ValueError as exc:
        parser.error(str(exc))
    http_limits = HttpLimits(**{f.name: getattr(a, f"http_{f.name}") for f in dataclasses.fields(HttpLimits)})
    grpc_limits = GrpcLimits(**{f.name: getattr(a, f"grpc_{f.name}") for f in dataclasses.fields(GrpcLimits)})
    limits = _sized_limits(parser, a, http_limits)
    return ServiceConfig(
        model_dir=a.model, host=a.host, port=a.port, metrics_host=a.metrics_host, metrics_port=a.metrics_port,
        http_host=a.http_host, http_port=a.http_port, http_limits=http_limits, engine=engine,
        limits=limits, shutdown_grace_seconds=a.shutdown_grace_seconds,
        log_level=a.log_level, api_keys=_api_keys(parser, a), tls=_tls(parser, a), grpc_limits=grpc_limits,
        api_server_count=a.api_server_count, engine_cores=a.engine_cores,
        front_link_host=_front_link_host(parser, a, keys),
        front_link_port=a.front_link_port, trusted_front_keys=a.trusted_front_keys,
        logprobs_mode=a.logprobs_mode, tool_calls=_tool_calls(parser, a), cors=_cors(parser, a))


def _fit_widths(parser: argparse.ArgumentParser, a: argparse.Namespace, scheduler: SchedulerConfig,
                given: set[str]) -> None:
    """--max-n and --max-beam-width fit one step: a wider request could never be scheduled. A default
    shrinks to fit (--max-num-seqs 8 alone must not fail on --max-n's 16); a value given fails."""
    room = min(scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
    for flag, dest in (("--max-n", "max_n"), ("--max-beam-width", "max_beam_width")):
        width = getattr(a, dest)
        if width <= room:
            continue
        if dest in given:
            parser.error(f"{flag}: must be <= --max-num-seqs and --max-num-batched-tokens ({room}), got {width}")
        setattr(a, dest, room)


def _lora_modules(parser: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[LoraModule, ...]:
    """--lora-modules, each adapter's files checked now: a bad one stops the service, saying why."""
    out = []
    served = a.served_model_name or Path(a.model).resolve().name  # (executors report the path's name)
    try:
        for text in split_lora_modules(a.lora_modules):
            name, path, _base = parse_lora_module(text)  # (the JSON form's base_model_name: display only)
            out.append(inspect_adapter(check_not_base_model(name, served), path, a.max_lora_rank))
    except LoraConfigError as exc:
        why = str(exc)  # (the adapter checks are shared with POST /v1/load_lora_adapter: name the flag)
        parser.error(why if why.startswith("--lora-modules") else f"--lora-modules: {why}")
    return tuple(out)


def _cors(parser: argparse.ArgumentParser, a: argparse.Namespace) -> CorsOptions | None:
    if not a.allowed_origins:
        for flag, given in (("--allowed-methods", a.allowed_methods), ("--allowed-headers", a.allowed_headers),
                            ("--allow-credentials", a.allow_credentials)):
            if given:
                parser.error(f"{flag}: only with --allowed-origins (no browser origin is allowed without it)")
        return None
    try:
        return CorsOptions(a.allowed_origins, a.allowed_methods or ("*",), a.allowed_headers or ("*",),
                           a.allow_credentials)
    except ValueError as exc:
        parser.error(str(exc))


def _tool_calls(parser: argparse.ArgumentParser, a: argparse.Namespace) -> ToolCallOptions:
    try:
        return ToolCallOptions(a.enable_auto_tool_choice, a.tool_call_parser)
    except ValueError as exc:
        parser.error(str(exc))


def _sized_limits(parser: argparse.ArgumentParser, a: argparse.Namespace, http: HttpLimits) -> ServerLimits:
    """ServerLimits with the caps given as 0 sized for this machine; the bytes cap must hold the
    largest request either front accepts, or such a request could never run."""
    limits = sized_for_machine(ServerLimits(**_fields(ServerLimits, a)), share=a.api_server_count)  # (per front)
    largest = max(http.max_body_bytes, MAX_REQUEST_BYTES)
    if limits.max_in_flight_bytes < largest:
        parser.error(f"--max-in-flight-bytes: must be >= the largest request a front accepts "
                     f"(--http-max-body-bytes, gRPC's {MAX_REQUEST_BYTES}): {largest}, got {limits.max_in_flight_bytes}")
    return limits
