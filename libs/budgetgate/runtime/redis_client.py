"""The Redis client of the ledger's users (admission, the reconciler, the CLI): redis-py's asyncio
client, with each command packed into the wire protocol by hiredis (C) instead of redis-py's
asyncio packer (Python). The rate limiter's client is the `limits` library's own.

redis-py's synchronous client already packs with hiredis when it is installed; its asyncio client
does not, and packs argument by argument in Python. Admission's check-and-reserve script takes a
few keys and arguments per decision, so a batch of 16 is one command of about 250 keys and
arguments: packing it in Python cost about 280 µs, hiredis about 80 µs (timeit), on the one core the
admission process runs on. The bytes sent are the same (tests/unit/test_redis_client.py).

A `redis+cluster://host:port` URL (`rediss+cluster://` with TLS; the `limits` library's scheme)
names a Redis Cluster by one of its nodes: `connect` returns redis-py's cluster client, which
finds the others and routes each command, and each Lua script, to the node serving its keys'
slot. Every key one script takes must then share a hash tag (budgetgate.ledger.redis_ledger).
Its connections pack with hiredis too, and one more thing: when the cluster client refreshes its
view of the cluster (a failover, a slot moved) it closes connections another task may be sending
on, and the send then fails inside redis-py as an AttributeError on the closed stream
(redis-py #3546 is the same race). Such a connection is lost, so it is raised as the
ConnectionError it is: the cluster client retries it on a fresh connection, and if that fails
too, the caller sees an outage (a 503), not a fault of the request (a 500).

And a second: every refresh of the cluster client's view re-reads the command table (`COMMAND`)
from its default node, the first master it lists. While that master is lost and not yet replaced
by its replica the cluster still lists it, the read fails, and so does every command the client
sends, to any slot, until the promotion: one master's failover would stop every shard of the
ledger. The table is the cluster's, the same on every node, so it is read once
(`_CommandTableOnce`).

And a third: redis-py's `aclose` of a cluster client closes nothing while the client waits to
refresh its view (a command met a lost node), so a service stopped during an outage, or a test
that ends in one, left its connections open; `_Cluster.aclose` closes them then too.
"""

from __future__ import annotations

import functools
from typing import Any

import redis
import redis.asyncio as aioredis
import redis.exceptions
from redis._parsers import AsyncCommandsParser
from redis.connection import HiredisRespSerializer
from redis.utils import HIREDIS_AVAILABLE

__all__ = ["CLUSTER_SCHEMES", "cluster_node_url", "connect", "connect_sync", "is_cluster_url"]

# A cluster URL's scheme → the scheme redis-py's cluster client parses.
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def cluster_node_url(url: str) -> str | None:
    """For a cluster URL (`redis+cluster://`, `rediss+cluster://`), the `redis://` (`rediss://`)
    URL of its node that redis-py's cluster clients take; None for any other URL."""
    scheme, _, rest = url.partition("://")
    plain = CLUSTER_SCHEMES.get(scheme.lower())
    return f"{plain}://{rest}" if plain is not None else None


def is_cluster_url(url: str) -> bool:
    """Whether `url` names a Redis Cluster (`redis+cluster://`, `rediss+cluster://`)."""
    return cluster_node_url(url) is not None


def connect_sync(url: str, **options: Any) -> redis.Redis:
    """A synchronous client of `url` (for command-line checks and tests): redis-py's own, or its
    cluster client for a cluster URL."""
    if (node := cluster_node_url(url)) is not None:
        return redis.RedisCluster.from_url(node, **options)  # type: ignore[return-value]
    return redis.Redis.from_url(url, **options)


def connect(url: str, **options: Any) -> aioredis.Redis:
    """`redis.asyncio.from_url(url, **options)`, packing its commands with hiredis when it is
    installed (a dependency of budgetgate's, redis[hiredis]); for a cluster URL, redis-py's
    cluster client (`redis.asyncio.RedisCluster`), which answers the same commands."""
    if (node := cluster_node_url(url)) is not None:
        # Typed as the single-node client its users are written against: the commands they
        # send (scripts, hashes, pipelines, SCAN) are the cluster client's too.
        cluster = _Cluster.from_url(node, **options)
        connection_class = _packed_by_hiredis(_ClusterConnection) if HIREDIS_AVAILABLE else _ClusterConnection
        # The nodes found later are made with these arguments; the ones given are made already.
        cluster.connection_kwargs["connection_class"] = connection_class
        for given in cluster.startup_nodes:
            given.connection_class = connection_class
        cluster.commands_parser = _CommandTableOnce()
        return cluster  # type: ignore[return-value]
    client = aioredis.from_url(url, **options)
    pool = client.connection_pool
    if HIREDIS_AVAILABLE:
        pool.connection_class = _packed_by_hiredis(pool.connection_class)  # TCP, TLS or a socket
    return client


class _HiredisPacking:
    _serializer = HiredisRespSerializer()

    def pack_command(self, *args: Any) -> list[bytes]:
        return self._serializer.pack(*args)


@functools.cache
def _packed_by_hiredis(base: type) -> type:
    return type(f"Hiredis{base.__name__}", (_HiredisPacking, base), {})


class _Cluster(aioredis.RedisCluster):
    """redis-py's asyncio cluster client whose `aclose` closes its connections even while it waits
    to refresh its view of the cluster (see the module doc)."""

    async def aclose(self) -> None:
        waiting = self._initialize
        await super().aclose()
        if waiting:
            await self.nodes_manager.aclose()
            await self.nodes_manager.aclose("startup_nodes")


class _CommandTableOnce(AsyncCommandsParser):
    """The cluster client's command table, read from a node once, not at every refresh of its view
    of the cluster (see the module doc): a refresh only points it at the new default node, for the
    commands whose keys it must ask a node for."""

    async def initialize(self, node: Any = None) -> None:
        if node is not None:
            self.node = node
        if not self.commands:
            await super().initialize()


class _ClusterConnection(aioredis.Connection):
    """A cluster node's connection on which a send that meets the stream closed under it (the
    cluster client's refresh disconnected it) is a lost connection (see the module doc)."""

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)
        except AttributeError as exc:
            if exc.obj is not None or exc.name not in ("writelines", "write", "drain"):
                raise
            raise redis.exceptions.ConnectionError("the connection was closed while a command was being sent on it") from exc
