"""Failed API-key attempts, rate-limited per peer, for both fronts.

Each peer has a token bucket of ``--auth-failure-burst`` attempts that refills by one every
``--auth-failure-refill-s`` seconds; a failed attempt (no key, or a key not accepted) takes one.
A peer whose bucket is empty is rejected at once with 429 / RESOURCE_EXHAUSTED, saying when to
retry, and its key is not even checked: checking it would let a guesser keep guessing at full
speed and only learn the answer later. Nothing sleeps: a rejection costs what a 401 costs, and
nothing of the call is held. (A delayed 401 instead would hold a task and a connection per
guess, which is what a flood of guesses wants.)

A peer is an IP address, an IPv6 one by its /64 (what one host is usually given). Peers behind
one proxy or NAT share its address and so its bucket: a client that keeps failing there makes
the others wait too. Only peers with failures are kept, a bucket that has refilled is dropped,
and the table holds at most ``max_peers`` (the least recently seen go first), so a client
rotating ports or addresses cannot grow it. Event loop only: no lock.
"""

from __future__ import annotations

import ipaddress
import time
from collections import OrderedDict
from collections.abc import Callable

MAX_PEERS = 16384  # ~2 MB of table at most


class AuthThrottle:
    def __init__(self, burst: int, refill_s: float, max_peers: int = MAX_PEERS,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if burst < 1 or refill_s <= 0 or max_peers < 1:
            raise ValueError(f"AuthThrottle: burst, refill_s and max_peers must be positive "
                             f"(got {burst}, {refill_s}, {max_peers})")
        self.burst, self.refill_s, self.max_peers, self.clock = burst, refill_s, max_peers, clock
        self._peers: OrderedDict[str, tuple[float, float]] = OrderedDict()  # peer -> (tokens, as of when)

    def __len__(self) -> int:
        return len(self._peers)

    def wait_s(self, peer: str) -> float:
        """0 if ``peer`` may try a key now, else the seconds until it may."""
        tokens = self._tokens(peer)
        return 0.0 if tokens >= 1 else (1 - tokens) * self.refill_s

    def failed(self, peer: str) -> None:
        """``peer`` sent no key or a wrong one."""
        self._peers[peer] = (self._tokens(peer) - 1, self.clock())
        self._peers.move_to_end(peer)
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)

    def _tokens(self, peer: str) -> float:
        entry = self._peers.get(peer)
        if entry is None:
            return float(self.burst)
        tokens = min(float(self.burst), entry[0] + (self.clock() - entry[1]) / self.refill_s)
        if tokens >= self.burst:  # refilled: nothing left to remember
            del self._peers[peer]
        return tokens


def peer_of_host(host: str | None) -> str:
    """The throttle's key for a client address: the IP, an IPv6 one's /64, a mapped IPv4 as IPv4."""
    if not host:
        return "unknown"
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])  # (an IPv6 zone index is not part of it)
    except ValueError:
        return host
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return str(ip)


def peer_of_grpc(peer: str) -> str:
    """The throttle's key for grpc's ``context.peer()``: ``ipv4:1.2.3.4:5678``,
    ``ipv6:[::1]:5678`` (or its %-encoded form); anything else (``unix:...``) by its scheme."""
    scheme, _, rest = peer.partition(":")
    rest = rest.replace("%5B", "[").replace("%5D", "]")
    if scheme == "ipv4":
        return peer_of_host(rest.rsplit(":", 1)[0])
    if scheme == "ipv6":
        return peer_of_host(rest.rsplit(":", 1)[0].strip("[]"))
    return scheme or "unknown"
