"""The address a request is counted against: the peer, unless it is a trusted proxy."""

from __future__ import annotations

import pytest

from budgetgate.edge.auth import AuthSettings
from budgetgate.edge.proxies import TrustedProxies, parse_networks


def scope(peer: str, *forwarded: str) -> dict:
    return {"client": (peer, 50000), "headers": [(b"x-forwarded-for", value.encode()) for value in forwarded]}


def test_without_trusted_proxies_the_peer_is_counted_whatever_a_header_says() -> None:
    nobody = TrustedProxies()
    assert nobody.client(scope("127.0.0.1", "203.0.113.9")) == "127.0.0.1"
    assert nobody.client(scope("10.1.2.3", "203.0.113.9, 10.1.2.4")) == "10.1.2.3"
    assert nobody.client({"client": None, "headers": []}) is None


def test_behind_trusted_proxies_the_right_most_untrusted_hop_is_counted() -> None:
    proxies = TrustedProxies(parse_networks(["10.0.0.0/8", "::1"]))
    # The client wrote the left-most hop itself; the proxy appended the address it saw.
    assert proxies.client(scope("10.0.0.5", "1.1.1.1, 203.0.113.9")) == "203.0.113.9"
    assert proxies.client(scope("10.0.0.5", "1.1.1.1", "203.0.113.9, 10.0.0.7")) == "203.0.113.9"  # two headers, two proxies
    assert proxies.client(scope("10.0.0.5", "[2001:db8::1]:443, 203.0.113.9:4711")) == "203.0.113.9"
    assert proxies.client(scope("::1", "2001:db8::7")) == "2001:db8::7"
    assert proxies.client(scope("10.0.0.5")) == "10.0.0.5"  # nothing forwarded: the proxy itself
    assert proxies.client(scope("10.0.0.5", "10.0.0.6, 10.0.0.7")) == "10.0.0.6"  # proxies all the way
    assert proxies.client(scope("10.0.0.5", "not-an-address")) == "not-an-address"  # a key of its own, never trusted
    # A peer that is not a trusted proxy is counted as itself, forwarded hops or not.
    assert proxies.client(scope("192.0.2.1", "203.0.113.9")) == "192.0.2.1"


def test_a_setting_that_is_not_an_address_or_network_is_refused() -> None:
    assert AuthSettings(trusted_proxies=["10.0.0.0/8", "2001:db8::/32", "127.0.0.1"]).trusted_proxies == ["10.0.0.0/8", "2001:db8::/32", "127.0.0.1"]
    with pytest.raises(ValueError, match="'10.0.0.0/33' is not an IP address or CIDR network"):
        AuthSettings(trusted_proxies=["10.0.0.0/33"])
    assert AuthSettings().trusted_proxies == []
