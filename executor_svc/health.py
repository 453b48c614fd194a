"""grpc.health.v1 for the executor: ``liveness`` while the process runs,
``executor`` SERVING once the scheduler accepted our handshake, NOT_SERVING
while (re)connecting and once draining.

Its port is its own: grpc would open it with SO_REUSEPORT (and so share it, silently, with another
executor given the same --health-port), so that is turned off, and a port in use stops the
executor naming the flag."""

from __future__ import annotations

import logging
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pagedserve.port_claim import PortUnavailable, claim_port
from pagedserve.wire import HEALTH_EXECUTOR_READY, HEALTH_LIVENESS

log = logging.getLogger(__name__)


class HealthServer:
    def __init__(self, port: int, host: str = "[::]") -> None:
        self._servicer = health.HealthServicer()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), options=[("grpc.so_reuseport", 0)])
        health_pb2_grpc.add_HealthServicer_to_server(self._servicer, self._server)
        try:
            self.port = self._server.add_insecure_port(f"{host}:{port}")
        except RuntimeError as exc:  # grpc says only "Failed to bind": find out why, to say so
            claim_port(host, port, "--health-host", "--health-port")
            raise PortUnavailable(f"--health-port {port}: cannot listen on {host} ({exc})") from None
        self._servicer.set(HEALTH_LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        self.set_ready(False)

    def start(self) -> HealthServer:
        self._server.start()
        log.info("health server on port %d", self.port)
        return self

    def set_ready(self, ready: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if ready else health_pb2.HealthCheckResponse.NOT_SERVING
        self._servicer.set(HEALTH_EXECUTOR_READY, status)

    def stop(self) -> None:
        self._servicer.enter_graceful_shutdown()
        self._server.stop(grace=0.5)
