"""The public gRPC API's server: the pagedserve.v1.Generation servicer (servicer.py), health and
reflection on one port, and the handlers in front of the servicer.

Before the servicer, in the call gate (call_gate.py): no accepted API key -> UNAUTHENTICATED; a
peer past its failed keys, no free slot or no room for the request's bytes -> RESOURCE_EXHAUSTED;
the request message not in within --grpc-message-timeout-s -> DEADLINE_EXCEEDED. A request
message is decoded, and a large one checked against the caps, before the servicer sees it. How
long connections may idle is grpc core's job (grpc_limits.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from tokenizers import Tokenizer

from pagedserve.engine_api import EngineApi
from pagedserve.v1 import generation_pb2 as pb
from pagedserve.wire import HEALTH_LIVENESS, HEALTH_SCHEDULER_READY
from scheduler_svc.front.grpc.call_gate import CallGate
from scheduler_svc.front.grpc.limits import MAX_REQUEST_BYTES, GrpcLimits, server_options
from scheduler_svc.front.grpc.servicer import GenerationServicer
from scheduler_svc.front.guards.admission import CallBudget
from scheduler_svc.front.guards.auth_throttle import AuthThrottle
from scheduler_svc.front.guards.request_caps import RequestCaps
from scheduler_svc.front.guards.request_size import request_bytes_for
from scheduler_svc.front.guards.security import ApiKeys, TlsFiles
from scheduler_svc.front.input.parse_pool import REFUSED, shared_worker
from scheduler_svc.front.input.server_limits import ServerLimits
from scheduler_svc.front.input.validation import LOGPROBS_MODES
from scheduler_svc.telemetry.metrics import Metrics

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
assert SERVICE_NAME == HEALTH_SCHEDULER_READY, "readiness is reported under the service's own name"
GENERATE_METHOD = f"/{SERVICE_NAME}/Generate"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class ApiServer:
    """A running gRPC server: Generation + health + reflection on one port."""

    server: grpc.aio.Server
    servicer: GenerationServicer
    health: health_aio.HealthServicer
    engine: EngineApi
    port: int
    _poller: asyncio.Task | None = field(default=None, repr=False)
    _reported: bool = field(default=False, repr=False)  # liveness already set NOT_SERVING

    async def update_health(self) -> None:
        """Recompute readiness, and liveness: NOT_SERVING once a loop of the engine died (then the
        process cannot serve again, and the orchestrator restarts it). The engine calls this on
        executor join/leave; a poll also does."""
        problem = self.engine.health_problem()
        ready = problem is None and self.engine.is_ready() and not self.servicer.shutting_down
        for service in ("", SERVICE_NAME):
            await self.health.set(service, SERVING if ready else NOT_SERVING)
        if problem is not None and not self._reported:
            self._reported = True
            log.critical("liveness is NOT_SERVING: %s", problem)
            await self.health.set(HEALTH_LIVENESS, NOT_SERVING)

    async def begin_shutdown(self) -> None:
        """Readiness off and new Generate calls rejected (UNAVAILABLE); running requests continue."""
        self.servicer.shutting_down = True
        await self.update_health()

    async def stop(self, grace: float) -> None:
        """Stop the server: running RPCs get ``grace`` seconds, then are cancelled (engine aborts them)."""
        if self._poller is not None:
            self._poller.cancel()
        await self.server.stop(grace)

    async def shutdown(self, grace: float) -> None:
        """begin_shutdown() then stop(grace)."""
        await self.begin_shutdown()
        await self.stop(grace)

    async def _poll_health(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            try:
                await self.update_health()
            except Exception:  # a probe must never kill the server
                log.exception("health update failed")


def _parsing(cls, method):
    """A servicer method taking the raw request bytes: a malformed message is INVALID_ARGUMENT
    (gRPC's own deserializer would make it UNKNOWN)."""

    async def handler(raw: bytes, context: grpc.aio.ServicerContext):
        try:
            request = [cls.FromString(raw)]
        except DecodeError as e:
            request, problem = None, str(e)
        raw = None  # this frame outlives the call in grpc's abort cycles: keep no prompt in it
        if request is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the request is not a valid {cls.DESCRIPTOR.full_name} message ({problem})")
        return await method(request.pop(), context)

    return handler


def _generation_handlers(servicer: GenerationServicer) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE_NAME, {
        "Generate": grpc.unary_stream_rpc_method_handler(
            _parsing(pb.GenerateRequest, servicer.Generate),
            response_serializer=pb.GenerateResponse.SerializeToString),
        "GetModelInfo": grpc.unary_unary_rpc_method_handler(
            _parsing(pb.GetModelInfoRequest, servicer.GetModelInfo),
            response_serializer=pb.ModelInfo.SerializeToString),
        "GetStats": grpc.unary_unary_rpc_method_handler(
            _parsing(pb.GetStatsRequest, servicer.GetStats), response_serializer=pb.Stats.SerializeToString),
    })


async def start_grpc_server(
    engine: EngineApi,
    tokenizer: Tokenizer,
    host: str = "0.0.0.0",
    port: int = 50051,
    limits: ServerLimits | None = None,
    metrics: Metrics | None = None,
    health_poll_interval: float | None = 1.0,
    api_keys: ApiKeys | None = None,
    tls: TlsFiles | None = None,
    grpc_limits: GrpcLimits | None = None,
    budget: CallBudget | None = None,
    throttle: AuthThrottle | None = None,
    reuse_port: bool = False,
    logprobs_mode: str = LOGPROBS_MODES[0],
    max_message_bytes: int = MAX_REQUEST_BYTES,
) -> ApiServer:
    """Bind and start the server (port 0: a free port, see ``.port``); must run in the engine's loop.

    ``health_poll_interval`` re-reads ``engine.is_ready()`` periodically as a
    safety net; the engine should still call ``update_health()`` on changes.
    ``api_keys``: calls need one (health excepted); ``tls``: the port serves TLS only.
    ``grpc_limits``: how long connections and request messages may take (grpc_limits.py).
    ``budget`` and ``throttle``: the ones the process's fronts share (admission.py,
    auth_throttle.py); by default this server's own, from ``limits``. ``reuse_port``: other
    processes of this host (the scheduler's fronts) serve the same port (SO_REUSEPORT).
    ``logprobs_mode``: the deployment's --logprobs-mode. ``max_message_bytes``: the largest request
    message grpc core reads (limits.max_receive_bytes).
    """
    limits = limits or ServerLimits()
    grpc_limits = grpc_limits or GrpcLimits()
    if api_keys is not None and throttle is None:
        throttle = AuthThrottle(limits.auth_failure_burst, limits.auth_failure_refill_s)
    def message_cap() -> int:
        info = engine.model_info()
        return max_message_bytes if info is None else min(max_message_bytes, request_bytes_for(info.max_model_len))

    async def generate_precheck(raw: bytes) -> str | None:
        """A large GenerateRequest's counts, read in the parse worker (request_caps.check_generate)."""
        info = engine.model_info()
        if info is None:
            return None  # the servicer answers UNAVAILABLE
        caps = RequestCaps.derive(limits, info, prompts=1, messages=0, tools=0)
        status, payload = await shared_worker().run("generate", caps.to_wire(), raw)
        return payload[1] if status == REFUSED else None

    gate = CallGate(grpc_limits.message_timeout_s, max_message_bytes, budget or CallBudget.from_limits(limits),
                    api_keys, throttle, metrics, message_cap, {GENERATE_METHOD: generate_precheck})
    servicer = GenerationServicer(engine, tokenizer, limits, metrics, logprobs_mode)
    health = health_aio.HealthServicer()
    server = grpc.aio.server(interceptors=[gate], options=[
        ("grpc.so_reuseport", int(reuse_port)), ("grpc.max_receive_message_length", max_message_bytes),
        *server_options(grpc_limits)])
    server.add_generic_rpc_handlers((_generation_handlers(servicer),))
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, tls.grpc_credentials()) if tls else server.add_insecure_port(address)
    api = ApiServer(server, servicer, health, engine, bound)
    await health.set(HEALTH_LIVENESS, SERVING)
    await api.update_health()
    await server.start()
    if health_poll_interval is not None:
        api._poller = asyncio.get_running_loop().create_task(api._poll_health(health_poll_interval))
    log.info("gRPC API listening on %s:%d (%s%s)", host, bound, "TLS" if tls else "plaintext",
             ", API keys required" if api_keys else "")
    return api
