"""Private servers for fault tests: kill one hard mid-test, then bring it back on the same port.

Postgres comes back with its data (crash recovery); Redis and Tansu keep nothing on disk, so they
come back empty, like a real restart of a non-persistent server.
"""

from __future__ import annotations

from budgetgate.devstack.embedded import EmbeddedServer
from budgetgate.devstack.postgres import EmbeddedPostgres


class KillableServer:
    """`.url` to connect to, `.stop()` to kill it hard (SIGKILL), `.start()` to restart it."""

    def __init__(self, server: EmbeddedServer) -> None:
        self._server = server

    @property
    def url(self) -> str:
        return self._server.url

    @property
    def port(self) -> int:
        assert self._server.port is not None
        return self._server.port

    @property
    def running(self) -> bool:
        return self._server.is_alive()

    def stop(self) -> None:
        """Kill the server and everything it forked, with no chance to clean up."""
        self._server.kill()

    def start(self) -> None:
        """Start it again on the same port; returns once it answers."""
        self._server.start()


class KillablePostgres(KillableServer):
    _server: EmbeddedPostgres

    @property
    def dsn(self) -> str:
        """DSN of the `postgres` database (create your own databases from it)."""
        return self._server.dsn()
