"""Escrow leases on a Redis Cluster whose master fails over to a replica that lagged behind it
(budgetgate.ledger.escrow_leases): the replica missed a return, so its lease is larger than the
one Postgres holds. It must admit nothing on that larger lease: the return advanced the shard's
ledger sequence, which Postgres recorded, so the promoted replica is behind and is rebuilt, with
Postgres's sizes, before it decides."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
import redis

from budgetgate.devstack.redis_cluster import EmbeddedRedisCluster
from budgetgate.ledger.redis_ledger import LedgerNotLoaded, RedisLedger
from budgetgate.runtime import redis_client
from tests.support.cluster_slots import node_of_slot, promoted, slot_of
from tests.support.escrow import BUDGET, Setup, reserve, shared_budget, sizes
from tests.support.waiting import wait_for

LIMIT = 1_000


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EmbeddedRedisCluster]:
    # Quick to notice a dead master: the failover comes a few seconds after the kill.
    with EmbeddedRedisCluster(tmp_path / "cluster", node_timeout_ms=1000) as started:
        yield started


@pytest.fixture
async def setup(cluster: EmbeddedRedisCluster, pg_dsn: str) -> AsyncIterator[Setup]:
    client = redis_client.connect(cluster.url, socket_timeout=5)
    async with asyncpg.create_pool(pg_dsn, min_size=1, max_size=4) as pool:
        try:
            yield await shared_budget(pool, RedisLedger(client, prefix="escrow-failover"), limit=LIMIT)
        finally:
            await client.aclose()


async def test_a_replica_that_missed_a_return_admits_nothing_on_the_larger_lease(cluster: EmbeddedRedisCluster, setup: Setup) -> None:
    s = setup
    assert await s.escrow.grant(BUDGET, "org-a", 600, reason="refill") == 600
    assert await reserve(s, "org-a", 100)
    master, replica = node_of_slot(cluster, slot_of(cluster, s.ledger.tag))

    # The replica's copy as of now (the lease at 600), kept on disk; then it is gone while the
    # master takes the return of 400 it will never see.
    replica.client().save()
    replica.kill()
    assert await s.escrow.give_back(BUDGET, "org-a", 400, reason="idle") == 400
    assert await sizes(s) == ({"org-a": 200}, {"org-a": 200})

    master.kill()
    replica.start()

    await promoted(replica)

    # 450 more would fit the lease the replica remembers (100 + 450 <= 600), not Postgres's (200).
    async def refused_as_behind() -> bool:
        try:
            admitted = await reserve(s, "org-a", 450)
        except LedgerNotLoaded:
            return True
        except (redis.exceptions.ConnectionError, redis.exceptions.ClusterError, redis.exceptions.TimeoutError):
            return False  # the cluster still settling: ask again
        raise AssertionError(f"the promoted replica answered ({'admitted' if admitted else 'refused'}) from a generation behind Postgres")

    await wait_for(refused_as_behind, timeout=60, what="the promoted replica to find itself behind")
    await s.sync.ensure_loaded()
    assert await sizes(s) == ({"org-a": 200}, {"org-a": 200})
    assert not await reserve(s, "org-a", 450)
    assert await reserve(s, "org-a", 200)  # the rebuild dropped the hold only Redis knew (never committed)
    master.start()
