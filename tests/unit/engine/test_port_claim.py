"""Public ports are claimed free of any other program before the fronts share them (SO_REUSEPORT)."""

from __future__ import annotations

import socket

import pytest

from pagedserve.port_claim import PortUnavailable, claim_port
from testing.stack import free_port


def _listener(port: int, reuse_port: bool) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    s.bind(("0.0.0.0", port))
    s.listen()
    return s


@pytest.mark.parametrize("reuse_port", [True, False])
@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0", "[::]", "localhost"])
def test_a_port_another_program_serves_is_refused_naming_the_flag(host, reuse_port):
    """Even a listener that shares with SO_REUSEPORT (a second scheduler's front): the fronts'
    own SO_REUSEPORT would otherwise join it and the two servers would answer in turn."""
    port = free_port()
    with _listener(port, reuse_port), pytest.raises(PortUnavailable) as e:
        claim_port(host, port, "--http-host", "--http-port")
    assert str(e.value).startswith(f"--http-port {port}: address in use on {host}")


def test_a_free_port_is_kept_and_zero_becomes_a_free_port():
    port = free_port()
    assert claim_port("127.0.0.1", port, "--host", "--port") == port
    picked = claim_port("127.0.0.1", 0, "--host", "--port")
    assert picked > 0
    with _listener(picked, reuse_port=False):  # (it was free: the claim holds nothing)
        pass


@pytest.mark.parametrize("host,message", [
    ("999.1.1.1", "--metrics-host 999.1.1.1: not an address this machine can listen on"),
    ("nosuchhost.invalid", "--metrics-host nosuchhost.invalid: not an address this machine can listen on"),
    ("192.0.2.1", "--metrics-host 192.0.2.1: cannot listen there (Cannot assign requested address)"),
])
def test_a_host_that_is_not_this_machines_is_refused_naming_the_flag(host, message):
    with pytest.raises(PortUnavailable) as e:
        claim_port(host, free_port(), "--metrics-host", "--metrics-port")
    assert str(e.value).startswith(message)
