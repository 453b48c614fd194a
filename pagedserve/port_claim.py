"""A listening port checked free before a server binds it, or told why not, naming the flag.

The scheduler's fronts share the gRPC and HTTP ports with SO_REUSEPORT (the kernel spreads
connections among them), and SO_REUSEPORT would just as gladly let them join a port that another
program, or a second scheduler, already serves: two servers answering in turn. So the scheduler
claims each public port here first, *without* SO_REUSEPORT, which Linux refuses while any other
socket holds it (one with SO_REUSEPORT too), and only then do the fronts bind it among
themselves. A port in use, or a host that does not resolve or is not this machine's, is a
:class:`PortUnavailable` naming the flag (the executor's health server reports its own bind
failures with it too: grpc says only "Failed to bind").
"""

from __future__ import annotations

import errno
import socket


class PortUnavailable(ValueError):
    """A port a service cannot listen on, given by its operator: the message names the flag and why."""


def claim_port(host: str, port: int, host_flag: str, port_flag: str) -> int:
    """``port`` once it is known to be free on ``host`` (every address the name resolves to), or a
    free one when it is 0 (the same for every front)."""
    addresses = _addresses(host, port, host_flag)
    if not port:  # the first address picks it; the others (localhost's ::1) must have it free too
        with socket.socket(*addresses[0][:3]) as s:
            s.bind(addresses[0][4])
            port = s.getsockname()[1]
        addresses = _addresses(host, port, host_flag)
    failures = []
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            # SO_REUSEADDR: a port whose last server left connections in TIME_WAIT is free (as the
            # fronts' bind sees it); a listener there is not.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise PortUnavailable(f"{port_flag} {port}: address in use on {host} (another process serves "
                                          f"it: a second scheduler or executor?); stop it or choose another port") from None
                failures.append(exc)
    if len(failures) == len(addresses):
        raise PortUnavailable(f"{host_flag} {host}: cannot listen there ({failures[0].strerror})")
    return port


def _addresses(host: str, port: int, host_flag: str) -> list[tuple]:
    try:
        return socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM,  # ([::]: grpc's form of ::)
                                  flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise PortUnavailable(f"{host_flag} {host}: not an address this machine can listen on ({exc})") from None
