"""Admission on a Redis Cluster while the cluster fails over to a replica that lagged behind its
master, and while the ledger's slot moves to another master, both in the middle of a burst.

What must hold (DESIGN's invariants): nothing is over-admitted (the ALLOWs Postgres holds never
exceed the hard limit), every answer is a decision or a fail-closed 503, and once the cluster
settles, Redis holds what Postgres holds. The ledger generation (the sequence every reservation
advances, recorded by Postgres with it) is what proves a promoted replica behind: it hands out a
sequence Postgres has committed already, and is rebuilt before it decides.

With one shard (the default) the ledger's keys share one hash tag, so its shard is the one master
serving that tag's slot; these tests find it with CLUSTER KEYSLOT and aim their faults there. The
last one runs six shards, and fails over the master of some of them while the others decide on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import asyncpg
import pytest
import redis

from budgetgate.devstack.redis_cluster import EmbeddedRedisCluster
from budgetgate.ledger.holds import sensitive_lease
from budgetgate.ledger.queries import sql
from tests.support.cluster_slots import node_of_slot, promoted, slot_of
from tests.support.admission import GPU_HOUR, apply_policies, budget_yaml, held_in_postgres, reserved_in_redis, submission
from tests.support.waiting import wait_for

LIMIT_GPU_HOURS = 60


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[EmbeddedRedisCluster]:
    # Quick to notice a dead master: the failover comes a few seconds after the kill.
    with EmbeddedRedisCluster(tmp_path / "cluster", node_timeout_ms=1000) as started:
        yield started


def body(i: int | str) -> dict[str, object]:
    return submission(run_id=f"burst-{i}", labels={"team": "vision"}, resources={"gpus": 1}, projected_runtime_hours=1.0)


async def _settled_and_audited(server, pg_dsn: str, asked: range) -> int:  # type: ignore[no-untyped-def]
    """Resend every submission until each has a decision (a 503 is retried, as a platform
    would), then check the invariants; returns how many were allowed."""

    async def all_decided() -> bool:
        answers = await _answers(server, asked)
        return all(status == 200 for status, _ in answers)

    await wait_for(all_decided, timeout=90, what="every submission decided once the cluster settled")
    held = await held_in_postgres(pg_dsn)
    assert len(held) == 1
    (allowed_units,) = held.values()
    assert allowed_units <= LIMIT_GPU_HOURS * GPU_HOUR, f"over-admitted: {allowed_units / GPU_HOUR} GPU-hours held against a limit of {LIMIT_GPU_HOURS}"

    async def redis_matches() -> bool:
        return await reserved_in_redis(server) == held

    await wait_for(redis_matches, timeout=60, what="Redis to hold what Postgres holds")
    return allowed_units // GPU_HOUR


async def _answers(server, indexes: range) -> list[tuple[int, str | None]]:  # type: ignore[no-untyped-def]
    replies = await asyncio.gather(*(server.client.post("/v1/admissions", json=body(i)) for i in indexes))
    return [(r.status_code, r.json().get("decision") if r.status_code == 200 else None) for r in replies]


async def test_a_failover_to_a_replica_that_lagged_mid_burst_over_admits_nothing(admission_factory, cluster, pg_dsn, settings) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("cluster-failover", limit=f"gpu_hours: {LIMIT_GPU_HOURS}")}, sha="c" * 40)
    server = await admission_factory(redis_url=cluster.url)
    await server.wait_ready()
    master, replica = node_of_slot(cluster, slot_of(cluster, server.rt.ledger.tag))

    first = await _answers(server, range(0, 20))
    assert first == [(200, "ALLOW")] * 20
    # The replica's copy as of now, kept on disk; then the replica is gone while the master takes
    # twenty more reservations it will never see.
    replica.client().save()
    replica.kill()
    second = await _answers(server, range(20, 40))
    assert second == [(200, "ALLOW")] * 20

    # The master dies; the replica comes back from its older copy (the ledger's marker and an
    # older generation in it) and is promoted by the cluster in the middle of the next burst.
    master.kill()
    replica.start()
    # It holds the ledger as it was (its marker included), a generation behind what Postgres committed.
    ledger = server.rt.ledger
    behind = redis.Redis(port=replica.port, single_connection_client=True)
    behind.execute_command("READONLY")
    assert behind.exists(ledger.marker)
    conn = await asyncpg.connect(pg_dsn)
    try:
        committed = await conn.fetchval("SELECT budgetgate_committed_ledger_seq()")
    finally:
        await conn.close()
    assert int(behind.get(ledger.sequence)) < committed
    behind.close()
    burst = asyncio.create_task(_answers(server, range(40, 80)))

    await promoted(replica)
    during = await burst
    assert {status for status, _ in during} <= {200, 503}
    master.start()  # back empty, with its cluster identity: it joins as the new master's replica

    allowed = await _settled_and_audited(server, pg_dsn, range(80))
    assert allowed == LIMIT_GPU_HOURS  # everything the limit had room for, and nothing past it


async def test_moving_the_ledger_slot_to_another_master_under_load_loses_nothing(admission_factory, cluster, pg_dsn, settings) -> None:
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("cluster-reshard", limit=f"gpu_hours: {LIMIT_GPU_HOURS}")}, sha="d" * 40)
    server = await admission_factory(redis_url=cluster.url)
    await server.wait_ready()
    slot = slot_of(cluster, server.rt.ledger.tag)
    source, _ = node_of_slot(cluster, slot)
    target = next(node for node in cluster.master_nodes if node is not source and node.is_alive())
    source_id, target_id = cluster.node_id(source), cluster.node_id(target)

    assert await _answers(server, range(0, 10)) == [(200, "ALLOW")] * 10
    moved = asyncio.Event()

    async def load() -> list[tuple[int, str | None]]:
        seen: list[tuple[int, str | None]] = []
        i = 10
        while not moved.is_set() and i < 70:
            seen += await _answers(server, range(i, i + 4))
            i += 4
        return seen

    loading = asyncio.create_task(load())
    await asyncio.sleep(0.3)
    # The resharding redis-cli --cluster reshard does, key by key (CLUSTER SETSLOT, MIGRATE).
    tgt, src = target.client(), source.client()
    tgt.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", source_id)
    src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", target_id)
    while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, 5):
        src.execute_command("MIGRATE", "127.0.0.1", target.port, "", 0, 5000, "KEYS", *keys)
        await asyncio.sleep(0.05)  # the load goes on between the moves, meeting ASK and TRYAGAIN
    for node in cluster.master_nodes:
        node.client().execute_command("CLUSTER", "SETSLOT", slot, "NODE", target_id)
    moved.set()
    during = await loading
    assert {status for status, _ in during} <= {200, 503}
    assert node_of_slot(cluster, slot)[0] is target

    allowed = await _settled_and_audited(server, pg_dsn, range(70))
    assert allowed == LIMIT_GPU_HOURS


SHARDED_TENANTS = [f"team-{i}" for i in range(12)]
SHARDED_LIMIT = 12


def tenant_body(tenant: str, i: int) -> dict[str, object]:
    return submission(run_id=f"{tenant}/burst-{i}", namespace="ml", labels={"team": tenant}, resources={"gpus": 1}, projected_runtime_hours=1.0, job=None)


async def _tenant_answers(server, tenants: list[str], indexes: range, body=tenant_body) -> dict[str, list[tuple[int, str | None]]]:  # type: ignore[no-untyped-def]
    asked = [(t, i) for i in indexes for t in tenants]
    replies = await asyncio.gather(*(server.client.post("/v1/admissions", json=body(t, i)) for t, i in asked))
    found: dict[str, list[tuple[int, str | None]]] = {t: [] for t in tenants}
    for (t, _i), r in zip(asked, replies, strict=True):
        found[t].append((r.status_code, r.json().get("decision") if r.status_code == 200 else None))
    return found


async def test_one_shard_failing_over_mid_burst_over_admits_nothing_and_the_others_decide_on(admission_factory, cluster, pg_dsn) -> None:
    """Six shards of the ledger over the cluster's three masters: the master serving one shard
    dies, its lagging replica is promoted in the middle of a burst of every tenant's
    submissions. The tenants of that master's shards get decisions or 503s, and none of their
    budgets is over-admitted (the promoted replica is a generation behind what Postgres committed
    of its shard, and is rebuilt alone); the tenants of the other masters' shards are decided
    throughout."""
    files = {f"{t}.yaml": budget_yaml(f"b-{t}", namespace="ml", labels=f"{{team: {t}}}", limit=f"gpu_hours: {SHARDED_LIMIT}") for t in SHARDED_TENANTS}
    await apply_policies(pg_dsn, files, sha="e" * 40)
    server = await admission_factory(redis_url=cluster.url, ledger_shards=6, pg_pool_max=30)
    await server.wait_ready()
    ledgers = server.rt.ledgers
    victim = ledgers.of_root(SHARDED_TENANTS[0])
    master, replica = node_of_slot(cluster, slot_of(cluster, victim.tag))
    served_by = {t: node_of_slot(cluster, slot_of(cluster, ledgers.of_root(t).tag))[0] for t in SHARDED_TENANTS}
    struck = [t for t in SHARDED_TENANTS if served_by[t] is master]
    bystanders = [t for t in SHARDED_TENANTS if served_by[t] is not master]
    assert bystanders, "every shard's slot is on one master: nothing to tell apart"

    assert all(a == [(200, "ALLOW")] * 4 for a in (await _tenant_answers(server, SHARDED_TENANTS, range(0, 4))).values())
    replica.client().save()
    replica.kill()
    assert all(a == [(200, "ALLOW")] * 4 for a in (await _tenant_answers(server, SHARDED_TENANTS, range(4, 8))).values())

    master.kill()
    replica.start()
    conn = await asyncpg.connect(pg_dsn)
    try:
        committed = await conn.fetchval(sql("committed_shard_seq"), victim.shard, len(ledgers))
    finally:
        await conn.close()
    behind = redis.Redis(port=replica.port, single_connection_client=True)
    behind.execute_command("READONLY")
    assert behind.exists(victim.marker) and int(behind.get(victim.sequence)) < committed  # its shard's generation, behind
    behind.close()
    # Rounds of every tenant's submissions from the master's loss until its replica is promoted,
    # so some fall between the cluster marking the master failed and the promotion (with
    # Redis's default cluster-require-full-coverage every node refuses every slot then).
    done = asyncio.Event()
    during: dict[str, list[tuple[int, str | None]]] = {t: [] for t in SHARDED_TENANTS}

    async def burst() -> int:
        index = 8
        while index < 16 or not done.is_set():
            for t, answers in (await _tenant_answers(server, SHARDED_TENANTS, range(index, index + 1))).items():
                during[t] += answers
            index += 1
        return index

    sending = asyncio.create_task(burst())
    await promoted(replica)
    done.set()
    sent = await sending
    assert {status for t in struck for status, _ in during[t]} <= {200, 503}
    assert all(status == 200 for t in bystanders for status, _ in during[t]), {t: during[t] for t in bystanders}
    master.start()

    async def all_decided() -> bool:
        answers = await _tenant_answers(server, SHARDED_TENANTS, range(sent))
        return all(status == 200 for a in answers.values() for status, _ in a)

    await wait_for(all_decided, timeout=90, what="every submission decided once the cluster settled")
    held = await held_in_postgres(pg_dsn)
    assert sorted(held.values()) == [SHARDED_LIMIT * GPU_HOUR] * len(SHARDED_TENANTS)  # each budget full, none past it

    async def redis_matches() -> bool:
        return await reserved_in_redis(server) == held

    await wait_for(redis_matches, timeout=60, what="Redis to hold what Postgres holds, on every shard")


SHARED_LIMIT = 100  # GPU-hours every tenant's runs share: less than their own budgets allow together


async def _bursts_through_a_lagging_failover(server, cluster, body=tenant_body) -> None:  # type: ignore[no-untyped-def]
    """Every tenant's submissions in rounds while the master serving the first tenant's shard
    dies and its replica, which missed the round before, is promoted in the middle of a burst;
    then until every submission is decided once the cluster settled."""
    master, replica = node_of_slot(cluster, slot_of(cluster, server.rt.ledgers.of_root(SHARDED_TENANTS[0]).tag))
    assert all(status == 200 for a in (await _tenant_answers(server, SHARDED_TENANTS, range(0, 4), body)).values() for status, _ in a)
    replica.client().save()
    replica.kill()
    assert all(status == 200 for a in (await _tenant_answers(server, SHARDED_TENANTS, range(4, 8), body)).values() for status, _ in a)
    master.kill()
    replica.start()
    burst = asyncio.create_task(_tenant_answers(server, SHARDED_TENANTS, range(8, 16), body))
    await promoted(replica)
    during = await burst
    assert {status for a in during.values() for status, _ in a} <= {200, 503}
    master.start()

    async def all_decided() -> bool:
        answers = await _tenant_answers(server, SHARDED_TENANTS, range(16), body)
        return all(status == 200 for a in answers.values() for status, _ in a)

    await wait_for(all_decided, timeout=90, what="every submission decided once the cluster settled")


async def test_a_budget_tenants_share_is_never_over_admitted_through_one_shards_failover(admission_factory, cluster, pg_dsn) -> None:
    """A budget every tenant shares, charged through each tenant's escrow lease on its own shard,
    while the master serving some shards dies and its lagging replica is promoted in the middle
    of a burst: the leases together never hold more than the budget's limit, nor any lease more
    than its size, no tenant's own budget goes past its limit, and Redis then holds what
    Postgres holds on every shard, the leases' sizes included."""
    files = {f"{t}.yaml": budget_yaml(f"b-{t}", namespace="ml", labels=f"{{team: {t}}}", limit=f"gpu_hours: {SHARDED_LIMIT}") for t in SHARDED_TENANTS}
    shared = budget_yaml("everyone", namespace="ml", labels="{}", limit=f"gpu_hours: {SHARED_LIMIT}")
    await apply_policies(pg_dsn, {**files, "shared.yaml": shared}, sha="a" * 40)
    server = await admission_factory(redis_url=cluster.url, ledger_shards=6, pg_pool_max=30)
    await server.wait_ready()
    await _bursts_through_a_lagging_failover(server, cluster)
    held = await held_in_postgres(pg_dsn)
    leases = {key: amount for key, amount in held.items() if "@" in key}
    assert all(amount <= SHARDED_LIMIT * GPU_HOUR for key, amount in held.items() if key not in leases)
    conn = await asyncpg.connect(pg_dsn)
    try:
        sizes = {r["lease_key"]: r["size"] for r in await conn.fetch("SELECT lease_key, size FROM escrow_leases")}
    finally:
        await conn.close()
    assert SHARED_LIMIT * GPU_HOUR // 2 <= sum(leases.values()) <= SHARED_LIMIT * GPU_HOUR  # the shared budget binds, and holds
    assert sum(sizes.values()) <= SHARED_LIMIT * GPU_HOUR and all(amount <= sizes[key] for key, amount in leases.items())

    async def redis_matches() -> bool:
        if await reserved_in_redis(server) != held:
            return False
        for key, size in sizes.items():
            ledger = server.rt.ledgers.of_key(key)
            if int(await ledger.client.hget(ledger.ledger(key), "size") or -1) != size:
                return False
        return True

    await wait_for(redis_matches, timeout=60, what="Redis to hold what Postgres holds, leases' sizes included, on every shard")


SENSITIVE_POOL = 60  # GPUs sensitive runs may hold at once: less than the tenants' own budgets allow together


def sensitive_body(tenant: str, i: int) -> dict[str, object]:
    return {**tenant_body(tenant, i), "labels": {"team": tenant, "sensitive": "true"}}


async def test_the_sensitive_pool_is_never_over_admitted_through_one_shards_failover(admission_factory, cluster, pg_dsn) -> None:
    """The sensitive-workload pool, carved into each tenant's lease (a counter on its shard),
    while the master serving some shards dies and its lagging replica is promoted in the middle of
    a burst: sensitive runs never hold more than the pool together, nor any tenant more than its
    lease, and Redis then holds what Postgres holds on every shard, the leases' sizes included."""
    files = {f"{t}.yaml": budget_yaml(f"b-{t}", namespace="ml", labels=f"{{team: {t}}}", limit=f"gpu_hours: {SHARDED_LIMIT}") for t in SHARDED_TENANTS}
    pool = f"apiVersion: budgetgate/v1\nkind: Quota\nmetadata: {{id: sensitive}}\nspec: {{sensitive_pool_size: {SENSITIVE_POOL}}}\n"
    await apply_policies(pg_dsn, {**files, "sensitive.yaml": pool}, sha="b" * 40)
    server = await admission_factory(redis_url=cluster.url, ledger_shards=6, pg_pool_max=30)
    await server.wait_ready()
    await _bursts_through_a_lagging_failover(server, cluster, sensitive_body)
    conn = await asyncpg.connect(pg_dsn)
    try:
        rows = await conn.fetch("SELECT tenant, sum(gpus)::int AS gpus FROM run_holds WHERE state = 'held' AND sensitive GROUP BY tenant")
        held = {r["tenant"]: r["gpus"] for r in rows}
        sizes = {r["root"]: r["size"] for r in await conn.fetch("SELECT root, size FROM counter_leases")}
    finally:
        await conn.close()
    assert SENSITIVE_POOL // 2 <= sum(held.values()) <= SENSITIVE_POOL  # the pool binds, and holds
    assert sum(sizes.values()) <= SENSITIVE_POOL and all(gpus <= sizes[t] for t, gpus in held.items()), (held, sizes)

    async def redis_matches() -> bool:
        for tenant in SHARDED_TENANTS:
            ledger = server.rt.ledgers.of_root(tenant)
            gpus, size = await ledger.client.hmget(ledger.keys.counter(sensitive_lease(tenant)), "gpus", "size")
            if (int(gpus or 0), int(size or 0)) != (held.get(tenant, 0), sizes.get(tenant, 0)):
                return False
        return True

    await wait_for(redis_matches, timeout=60, what="Redis to hold what Postgres holds of the sensitive pool, leases' sizes included, on every shard")
