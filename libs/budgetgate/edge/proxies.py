"""Which address a request comes from, for the limit on unknown API tokens: the connection's
peer, unless that peer is a proxy the operator named as trusted; then the right-most hop of
X-Forwarded-For that is not a trusted proxy (the one the nearest trusted proxy saw). Hops left of
it are the client's own words and are never believed. Pure: no I/O."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Any

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def parse_networks(entries: Iterable[str]) -> tuple[Network, ...]:
    """Addresses or CIDR networks ("10.0.0.0/8", "::1"); raises ValueError naming a bad one."""
    networks = []
    for entry in entries:
        try:
            networks.append(ipaddress.ip_network(entry.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{entry!r} is not an IP address or CIDR network (e.g. 10.0.0.0/8)") from None
    return tuple(networks)


class TrustedProxies:
    """The proxies whose X-Forwarded-For is believed; none by default."""

    def __init__(self, networks: Iterable[Network] = ()) -> None:
        self.networks = tuple(networks)

    def trusts(self, host: str | None) -> bool:
        if not self.networks or not host:
            return False
        try:
            address = ipaddress.ip_address(host)
        except ValueError:
            return False
        return any(address in network for network in self.networks)

    def client(self, scope: Any) -> str | None:
        """The address a request counts against, from its ASGI scope."""
        peer = scope.get("client")
        host = peer[0] if peer else None
        if not self.trusts(host):
            return host
        hops = [_host(hop) for name, value in scope["headers"] if name.lower() == b"x-forwarded-for" for hop in value.decode("latin-1").split(",")]
        hops = [hop for hop in hops if hop]
        for hop in reversed(hops):
            if not self.trusts(hop):
                return hop
        # Every hop is a trusted proxy (or none was forwarded): the left-most is the farthest known.
        return hops[0] if hops else host


def _host(hop: str) -> str:
    """An X-Forwarded-For entry without its port: "203.0.113.7:4711", "[2001:db8::1]:443"."""
    hop = hop.strip()
    if hop.startswith("["):
        return hop[1 : hop.find("]")] if "]" in hop else hop
    if hop.count(":") == 1:
        return hop.split(":", 1)[0]
    return hop
