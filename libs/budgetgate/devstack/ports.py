"""TCP ports on the loopback interface: find a free one, see whether one answers."""

from __future__ import annotations

import random
import socket

# Chosen below the kernel's ephemeral range (32768+ on Linux), so a port picked here is not
# handed out meanwhile as the source port of some outgoing connection, and a server restarted
# on the same port after a kill finds it still free.
_LOW, _HIGH = 20000, 32000


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now, picked at random so parallel stacks rarely collide."""
    for _ in range(200):
        port = random.randrange(_LOW, _HIGH)
        if bindable(host, port):
            return port
    raise RuntimeError(f"no free TCP port found on {host} between {_LOW} and {_HIGH}")


def bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def port_open(host: str, port: int, *, timeout: float = 0.5) -> bool:
    """True when something accepts TCP connections on host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def split_host_port(address: str, default_port: int) -> tuple[str, int]:
    """'host:port' (or '[v6]:port', or just 'host') as a tuple."""
    address = address.strip()
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, int(rest.lstrip(":") or default_port)
    host, sep, port = address.rpartition(":")
    if not sep:
        return address, default_port
    return host, int(port)
