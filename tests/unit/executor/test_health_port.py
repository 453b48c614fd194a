"""The executor's health port is its own: a second executor given it stops, naming the flag."""

from __future__ import annotations

import pytest

from executor_svc.health import HealthServer
from pagedserve.port_claim import PortUnavailable
from testing.stack import free_port


def test_a_second_health_server_on_the_same_port_is_refused():
    port = free_port()
    first = HealthServer(port, "127.0.0.1").start()
    try:
        with pytest.raises(PortUnavailable) as e:
            HealthServer(port, "127.0.0.1")  # grpc's default SO_REUSEPORT let this one share it
        assert str(e.value).startswith(f"--health-port {port}: address in use on 127.0.0.1")
    finally:
        first.stop()


def test_port_zero_still_picks_a_free_port():
    a, b = HealthServer(0, "127.0.0.1"), HealthServer(0, "127.0.0.1")
    assert a.port > 0 and b.port > 0 and a.port != b.port
    a.stop()
    b.stop()
