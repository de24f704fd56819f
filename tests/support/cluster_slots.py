"""Where a hash tag's slot lives on an embedded Redis Cluster: for fault tests that aim a failover
or a resharding at the master serving the ledger's keys."""

from __future__ import annotations

import asyncio
import time

import redis

from budgetgate.devstack.redis_cluster import ClusterNode, EmbeddedRedisCluster


def node_of_slot(cluster: EmbeddedRedisCluster, slot: int) -> tuple[ClusterNode, ClusterNode]:
    """The live master serving `slot`, and its replica."""
    view = cluster.known_nodes(cluster.nodes[0])
    by_id = {cluster.node_id(node): node for node in cluster.nodes if node.is_alive()}
    for node_id, fields in view.items():
        flags = fields[1].split(",")
        if "master" not in flags or "fail" in flags:
            continue
        for part in fields[7:]:
            if part.startswith("["):
                continue  # a slot being migrated or imported
            low, _, high = part.partition("-")
            if int(low) <= slot <= int(high or low):
                replica = next(by_id[r] for r, f in view.items() if "slave" in f[1].split(",") and f[2] == node_id and r in by_id)
                return by_id[node_id], replica
    raise AssertionError(f"no live master serves slot {slot}")


def slot_of(cluster: EmbeddedRedisCluster, tag: str) -> int:
    return int(cluster.nodes[0].client().execute_command("CLUSTER", "KEYSLOT", tag))


async def promoted(replica: ClusterNode, *, timeout: float = 30) -> None:
    """Once the cluster has promoted `replica` to master (its master dead); fails after `timeout` s."""

    def is_master() -> bool:
        try:
            return replica.client().info("replication").get("role") == "master"
        except redis.RedisError:
            return False

    deadline = time.monotonic() + timeout
    while not is_master():
        assert time.monotonic() < deadline, "the cluster never promoted the replica"
        await asyncio.sleep(0.2)
