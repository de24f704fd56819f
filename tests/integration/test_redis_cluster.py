"""The embedded Redis Cluster (budgetgate.devstack.redis_cluster), the clients that reach it by a
`redis+cluster://` URL, and `budgetgate dev up --redis-cluster`, on real redis-server processes.

The ledger suites run on such a cluster too: `BUDGETGATE_TEST_REDIS=cluster` (tests/support/backends).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from limits import parse
from limits.aio.strategies import FixedWindowRateLimiter
from redis.asyncio import RedisCluster

from budgetgate.devstack.redis_cluster import SLOTS, EmbeddedRedisCluster
from budgetgate.edge.auth import _shared_storage
from budgetgate.ledger import rewrite
from budgetgate.ledger.redis_ledger import RedisLedger
from budgetgate.ledger.sharded import FULL_COVERAGE, whole_cluster_stops
from budgetgate.runtime import redis_client
from tests.support.cli import budgetgate_on
from tests.support.waiting import wait_for
from tests.support.devstack import alive_pids, checkout, dev, new_checkout, not_zombie, status  # noqa: F401 - checkout, new_checkout: fixtures


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedisCluster]:
    with EmbeddedRedisCluster(tmp_path_factory.mktemp("redis-cluster")) as started:
        yield started


def _masters_and_replicas(cluster: EmbeddedRedisCluster) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Per master id its slot count as CLUSTER SLOTS says; per replica id its master's id."""
    view = cluster.known_nodes(cluster.nodes[0])
    masters = {node_id: fields for node_id, fields in view.items() if "master" in fields[1].split(",")}
    replicas = {node_id: fields[2] for node_id, fields in view.items() if "slave" in fields[1].split(",")}
    slots: dict[str, list[int]] = {node_id: [] for node_id in masters}
    for node_id, fields in masters.items():
        for part in fields[7:]:
            low, _, high = part.partition("-")
            slots[node_id].extend(range(int(low), int(high or low) + 1))
    return slots, replicas


def test_three_masters_share_every_slot_and_each_has_a_replica_of_its_own(cluster: EmbeddedRedisCluster) -> None:
    slots, replicas = _masters_and_replicas(cluster)
    assert len(slots) == 3
    assert sorted(s for owned in slots.values() for s in owned) == list(range(SLOTS))
    assert sorted(replicas.values()) == sorted(slots)  # one replica per master, none left without
    assert cluster.healthy()
    assert cluster.url.startswith("redis+cluster://127.0.0.1:")


async def test_connect_reaches_every_master_and_runs_a_script_on_the_slot_of_its_keys(cluster: EmbeddedRedisCluster) -> None:
    client = redis_client.connect(cluster.url, socket_timeout=5)
    assert isinstance(client, RedisCluster)
    try:
        for tag in range(30):
            await client.set(f"{{org-{tag}}}:n", tag)
        # The keys went to the master serving their slot: with thirty tags, every master holds some.
        held = [node.client().dbsize() for node in cluster.master_nodes]
        assert sum(held) == 30 and all(count > 0 for count in held)
        script = client.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1]) + redis.call('INCRBY', KEYS[2], ARGV[1])")
        assert await script(keys=["{org-1}:a", "{org-1}:b"], args=[5]) == 10
        with pytest.raises(redis.exceptions.RedisClusterException):  # keys of two slots: refused by the client
            await script(keys=["{org-1}:a", "{org-2}:b"], args=[1])
    finally:
        await client.aclose()


async def test_a_rebuild_whose_first_command_is_its_claim_runs_on_a_new_cluster_client(cluster: EmbeddedRedisCluster) -> None:
    """`budgetgate ledger rebuild-redis` and a forced rebuild begin with a MULTI/EXEC (the fence's
    claim). redis-py's cluster client failed one sent before it had found the nodes ("attached
    to a different loop"); rewrite.replace_all has it find them first."""
    client = redis_client.connect(cluster.url, socket_timeout=5)
    ledger = RedisLedger(client, prefix="rebuild-first")
    try:

        async def holding() -> None:
            return None

        await rewrite.replace_all(ledger, ledgers={"k|w|gpu_hours": (3, 4)}, runs={}, generation="g", holding=holding, seq=7, sizes={"k|w|gpu_hours": 9})
        assert await ledger.is_loaded() and await ledger.readings(["k|w|gpu_hours"]) == {"k|w|gpu_hours": (3, 4)}
        assert await ledger.sizes(["k|w|gpu_hours"]) == {"k|w|gpu_hours": 9}
    finally:
        await client.aclose()


async def test_a_rate_limit_shared_by_instances_counts_once_on_a_cluster(cluster: EmbeddedRedisCluster) -> None:
    limit = parse("3/minute")
    instances = [FixedWindowRateLimiter(_shared_storage(cluster.url, key_prefix="{test-rl}:ratelimit")) for _ in range(2)]
    hits = [await instances[i % 2].hit(limit, "caller") for i in range(5)]
    assert hits == [True, True, True, False, False]
    for limiter in instances:
        client = limiter.storage.bridge.storage  # type: ignore[attr-defined]
        await client.aclose()


def test_connect_sync_of_a_cluster_url_sees_keys_on_every_master(cluster: EmbeddedRedisCluster) -> None:
    client = redis_client.connect_sync(cluster.url)
    try:
        for tag in range(12):
            client.set(f"{{sync-{tag}}}:k", 1)
        assert len(list(client.scan_iter(match="{sync-*", count=100))) == 12
    finally:
        client.close()


def test_dev_up_redis_cluster_starts_six_nodes_and_down_stops_them(checkout: Path, postgres_admin_dsn: str, kafka_server_bootstrap: str) -> None:
    from budgetgate.devstack.isolation import checkout_tag, database_name

    env = {"BUDGETGATE_POSTGRES_DSN": postgres_admin_dsn, "BUDGETGATE_KAFKA_BOOTSTRAP": kafka_server_bootstrap}
    database = database_name(checkout_tag(checkout))
    try:
        started = dev(checkout, "up", "--detach", "--no-services", "--redis-cluster", env=env)
        assert started.returncode == 0, started.stderr
        info = status(checkout)
        assert info["up"] is True
        assert info["redis_url"].startswith("redis+cluster://")
        nodes = {name: pid for name, pid in alive_pids(info).items() if name.startswith("redis-node-")}
        assert len(nodes) == 6
        redis_row = next(s for s in info["services"] if s["name"] == "redis")
        assert redis_row["started_here"] and redis_row["alive"]
        client = redis_client.connect_sync(info["redis_url"])
        try:
            assert client.ping()
            assert client.cluster_info()["cluster_state"] == "ok"
        finally:
            client.close()
        # A BUDGETGATE_REDIS_URL that names one server is no cluster: refused, not ignored.
        refused = dev(checkout, "up", "--detach", "--no-services", "--redis-cluster", env={**env, "BUDGETGATE_REDIS_URL": "redis://127.0.0.1:6379/0"})
        assert refused.returncode == 0 and "already up" in refused.stdout  # the running stack answers first
        assert dev(checkout, "down").returncode == 0
        assert not any(Path(f"/proc/{pid}").exists() and not_zombie(pid) for pid in nodes.values())
        refused = dev(checkout, "up", "--detach", "--no-services", "--redis-cluster", env={**env, "BUDGETGATE_REDIS_URL": "redis://127.0.0.1:6379/0"})
        assert refused.returncode != 0
        assert "names no cluster" in refused.stderr
        assert not (checkout / ".budgetgate" / "dev.json").exists() or json.loads((checkout / ".budgetgate" / "dev.json").read_text())["processes"] == []
    finally:
        dev(checkout, "down")
        from tests.support.databases import _execute, run_async

        run_async(lambda: _execute(postgres_admin_dsn, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)'))


async def test_a_cluster_connection_closed_under_a_send_is_a_lost_connection(cluster: EmbeddedRedisCluster) -> None:
    # The race the cluster client's refresh makes: the connection checked open, then closed by
    # another task before the command is written. Its connection class says so as an outage.
    client = redis_client.connect(cluster.url, socket_timeout=5)
    try:
        await client.ping()
        connection_class = client.connection_kwargs["connection_class"]
        connection = connection_class(host="127.0.0.1", port=cluster.nodes[0].port, socket_timeout=5)
        await connection.connect()
        writer = connection._writer
        assert writer is not None

        async def closed_meanwhile() -> None:
            connection._writer = None
            writer.close()

        connection.check_health = closed_meanwhile  # type: ignore[method-assign]
        with pytest.raises(redis.exceptions.ConnectionError, match="closed while a command was being sent"):
            await connection.send_packed_command(connection.pack_command("PING"))
        # Every node of the client, found or given, makes connections of that class.
        assert {type(node).__name__ for node in client.get_nodes()} == {"ClusterNode"}
        assert all(node.connection_class is connection_class for node in client.get_nodes())
        await connection.disconnect()
        await writer.wait_closed()
    finally:
        await client.aclose()


def test_dev_up_checks_an_external_cluster_by_its_url(cluster: EmbeddedRedisCluster) -> None:
    from budgetgate.devstack.isolation import ExternalServerError, check_redis

    check_redis(cluster.url)  # answers: a stack may use it (BUDGETGATE_REDIS_URL=redis+cluster://...)
    with pytest.raises(ExternalServerError, match="does not answer"):
        check_redis("redis+cluster://127.0.0.1:9")


async def test_a_master_lost_for_good_stops_only_its_own_slots(tmp_path: Path) -> None:
    """A master dies and nothing replaces it (its replica is gone too): its slots fail, every other
    slot is served on. Two things stood in the way: Redis's default
    `cluster-require-full-coverage yes`, under which every node refuses every command once the
    master is marked failed (the embedded cluster sets it to no), and redis-py's cluster client,
    whose every refresh re-read the command table from its default node, the first master it
    lists, so that a refresh listing the lost master first failed every command to any slot
    (budgetgate.runtime.redis_client reads the table once)."""
    with EmbeddedRedisCluster(tmp_path / "cluster") as cluster:
        client = redis_client.connect(cluster.url, socket_timeout=5)
        try:
            keys = [f"{{k{i}}}" for i in range(30)]
            for key in keys:
                await client.set(key, "1")
            lost = client.get_default_node()
            on_lost = next(key for key in keys if client.get_node_from_key(key).name == lost.name)
            elsewhere = [key for key in keys if client.get_node_from_key(key).name != lost.name]
            master = next(node for node in cluster.master_nodes if node.port == lost.port)
            lost_id = next(node_id for node_id, fields in cluster.known_nodes(master).items() if "myself" in fields[1])
            for node in cluster.replica_nodes:
                if int(node.client().info("replication")["master_port"]) == lost.port:
                    node.kill()
            master.kill()
            witness = next(node for node in cluster.master_nodes if node is not master)
            deadline = asyncio.get_running_loop().time() + 30
            while "fail" not in cluster.known_nodes(witness)[lost_id][1].split(","):
                assert asyncio.get_running_loop().time() < deadline, "the cluster never marked the lost master failed"
                await asyncio.sleep(0.2)

            with pytest.raises(redis.exceptions.ConnectionError):
                await client.get(on_lost)  # the client will refresh its view before its next command
            # ... and that refresh lists the lost master first, as it did once under load.
            cache = client.nodes_manager.nodes_cache
            client.nodes_manager.nodes_cache = {lost.name: cache[lost.name], **{name: node for name, node in cache.items() if name != lost.name}}
            assert await asyncio.gather(*(client.get(key) for key in elsewhere)) == [b"1"] * len(elsewhere)
            with pytest.raises(redis.exceptions.ConnectionError):
                await client.get(on_lost)  # (the client waits to refresh its view again)
        finally:
            await client.aclose()
        # Closed although it was waiting to refresh its view (redis-py's own aclose closes nothing then).
        assert [c for node in client.nodes_manager.nodes_cache.values() for c in node._connections if c.is_connected] == []


async def test_a_cluster_on_which_one_failover_stops_every_shard_is_warned_of(
    cluster: EmbeddedRedisCluster, settings, admission_factory, caplog, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    """A master with Redis's default cluster-require-full-coverage yes is named, by the function
    admission warns with at its start and by `budgetgate ledger check`; with one shard, or every
    master at no (the embedded cluster's own setting), nothing is said."""
    client = redis_client.connect(cluster.url, socket_timeout=5)
    master = cluster.master_nodes[1]
    try:
        assert await whole_cluster_stops(client, 3) is None
        master.client().config_set(FULL_COVERAGE, "yes")
        warning = await whole_cluster_stops(client, 3)
        assert warning is not None and f"masters 127.0.0.1:{master.port} have {FULL_COVERAGE} yes" in warning
        assert await whole_cluster_stops(client, 1) is None
        on_cluster = {"BUDGETGATE_REDIS_URL": cluster.url, "BUDGETGATE_LEDGER_SHARDS": "3"}
        checked = await budgetgate_on(settings, "ledger", "check", cwd=tmp_path, variables=on_cluster)
        assert f"warning: the Redis Cluster's masters 127.0.0.1:{master.port} have" in checked.stdout, checked
        with caplog.at_level(logging.WARNING, logger="budgetgate.services.admission.service"):
            server = await admission_factory(redis_url=cluster.url, ledger_shards=3)
            await wait_for(lambda: any(FULL_COVERAGE in r.getMessage() for r in caplog.records), timeout=30, what="admission's warning at its start")
        await server.stop()
    finally:
        master.client().config_set(FULL_COVERAGE, "no")
        await client.aclose()
