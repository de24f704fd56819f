"""Kill Postgres or Redis under admission, then check the ledger invariants once they return."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest
import redis.asyncio as aioredis

from budgetgate.core.reconciliation import Rules
from budgetgate.ledger.queries import owned_by
from budgetgate.policies.policy_store import PolicyStore
from budgetgate.services.reconciler.settler import Settler
from tests.support.databases import private_database
from tests.support.clock import this_month
from tests.support.sharded import SHARDS, TENANTS, held_in_redis, policies as sharded_policies, run as sharded_run
from tests.support.waiting import wait_for
from tests.support.admission import (
    apply_policies,
    budget_yaml,
    decision_of,
    GPU_HOUR,
    held_in_postgres,
    one_batch,
    reserved_in_redis,
    restart_from_snapshot,
    submission,
)

sql = owned_by("budgetgate.services.reconciler")  # its own queries, then the shared ledger's

LIMIT = budget_yaml("faulty", limit="gpu_hours: 100")


def body(i: int | str) -> dict[str, object]:
    return submission(run_id=f"run-{i}", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=1.0)


async def ready(server) -> bool:  # type: ignore[no-untyped-def]
    try:
        return (await server.client.get("/readyz")).status_code == 200
    except Exception:  # noqa: BLE001 - the server may be mid-restart of a dependency
        return False


async def test_postgres_stopped_mid_burst_answers_503_and_leaks_nothing(admission_factory, killable_postgres) -> None:
    dsn = await private_database(killable_postgres.dsn)
    await apply_policies(dsn, {"b.yaml": LIMIT}, sha="d" * 40)
    server = await admission_factory(postgres_dsn=dsn, pg_pool_max=30)
    await server.wait_ready()
    assert decision_of(await server.client.post("/v1/admissions", json=body("before"))) == "ALLOW"

    async def stop_soon() -> None:
        # The scenario, not a wait for an effect: the kill lands while the burst is being decided.
        await asyncio.sleep(0.03)
        killable_postgres.stop()

    results = await asyncio.gather(stop_soon(), *(server.client.post("/v1/admissions", json=body(i)) for i in range(60)))
    answers = [r for r in results if r is not None]
    assert {a.status_code for a in answers} <= {200, 503}
    assert any(a.status_code == 503 for a in answers)
    refused = await server.client.post("/v1/admissions", json=body("while-down"))
    assert refused.status_code == 503 and "unavailable" in refused.json()["detail"]
    assert (await server.client.get("/readyz")).status_code == 503

    killable_postgres.start()
    await wait_for(lambda: ready(server), what="admission ready once Postgres is back")
    held = await held_in_postgres(dsn)
    # Every reservation Redis holds is one Postgres holds: nothing reserved for a 503.
    assert await reserved_in_redis(server) == held
    allowed = [a for a in answers if a.status_code == 200 and a.json()["decision"] == "ALLOW"]
    assert list(held.values()) == [(1 + len(allowed)) * 8 * GPU_HOUR]
    # And the budget still admits exactly what fits after the outage.
    after = await asyncio.gather(*(server.client.post("/v1/admissions", json=body(f"after-{i}")) for i in range(20)))
    assert all(a.status_code == 200 for a in after)
    assert list((await held_in_postgres(dsn)).values()) == [96 * GPU_HOUR]


async def test_redis_restarted_empty_is_rebuilt_before_deciding(admission_factory, killable_redis, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": LIMIT}, sha="d" * 40)
    server = await admission_factory(redis_url=killable_redis.url, pg_pool_max=30)
    await server.wait_ready()
    first = await asyncio.gather(*(server.client.post("/v1/admissions", json=body(i)) for i in range(5)))
    assert [a.json()["decision"] for a in first] == ["ALLOW"] * 5

    killable_redis.stop()
    refused = await server.client.post("/v1/admissions", json=body("while-down"))
    assert refused.status_code == 503
    assert (await server.client.get("/readyz")).status_code == 503

    killable_redis.start()  # comes back empty, as a Redis without persistence does
    answers = await asyncio.gather(*(server.client.post("/v1/admissions", json=body(f"after-{i}")) for i in range(20)))
    assert {a.status_code for a in answers} <= {200, 503}
    allowed_after = sum(a.status_code == 200 and a.json()["decision"] == "ALLOW" for a in answers)
    assert allowed_after == 12 - 5
    held = await held_in_postgres(pg_dsn)
    assert list(held.values()) == [96 * GPU_HOUR]
    assert await reserved_in_redis(server) == held


async def test_orphaned_redis_hold_is_released_when_the_run_retries(admission_factory, pg_dsn) -> None:
    await apply_policies(pg_dsn, {"b.yaml": LIMIT}, sha="d" * 40)
    server = await admission_factory()
    await server.wait_ready()
    # A process reserved for run "crashed" and died before committing: Redis holds 96 GPU-hours
    # that Postgres knows nothing about.
    warmup = await server.client.post("/v1/admissions", json=body("warmup"))
    assert warmup.json()["decision"] == "ALLOW"
    [key] = (await held_in_postgres(pg_dsn)).keys()
    from budgetgate.ledger.redis_ledger import ChargeRequest

    orphan = await server.rt.ledger.reserve(
        run_id="run-crashed", decision_id=str(uuid.uuid4()), charges=[ChargeRequest(key, 88 * GPU_HOUR, 100 * GPU_HOUR, True)], now_ms=0
    )
    assert orphan.status == "RESERVED"
    retried = await server.client.post("/v1/admissions", json=body("crashed"))
    assert retried.json()["decision"] == "ALLOW" and retried.json()["replayed"] is False
    held = await held_in_postgres(pg_dsn)
    assert list(held.values()) == [16 * GPU_HOUR]
    assert await reserved_in_redis(server) == held


@pytest.mark.parametrize("kill", ["redis", "postgres"])
async def test_nothing_is_reserved_when_a_backend_is_down_from_the_start(admission_factory, pg_dsn, killable_redis, killable_postgres, kill) -> None:
    dsn = await private_database(killable_postgres.dsn)
    await apply_policies(dsn, {"b.yaml": LIMIT}, sha="d" * 40)
    server = await admission_factory(postgres_dsn=dsn, redis_url=killable_redis.url)
    await server.wait_ready()
    (killable_redis if kill == "redis" else killable_postgres).stop()
    answers = await asyncio.gather(*(server.client.post("/v1/admissions", json=body(i)) for i in range(10)))
    assert [a.status_code for a in answers] == [503] * 10
    (killable_redis if kill == "redis" else killable_postgres).start()
    await wait_for(lambda: ready(server), what=f"admission ready once {kill} is back")
    assert await held_in_postgres(dsn) == {}
    assert await reserved_in_redis(server) == {}


async def test_a_read_only_redis_answers_503_and_reserves_nothing(admission_factory, pg_dsn, killable_redis) -> None:
    # A Redis turned into a replica (a demoted primary after a failover) refuses the reserve
    # script's writes with READONLY, inside the script: a plain ResponseError to redis-py, which
    # was answered 500 to a whole batch. It is an outage: 503, nothing held, and the service
    # decides again as soon as Redis takes writes.
    await apply_policies(pg_dsn, {"b.yaml": LIMIT}, sha="e" * 40)
    server = await admission_factory(redis_url=killable_redis.url)
    await server.wait_ready()
    assert decision_of(await server.client.post("/v1/admissions", json=body("before"))) == "ALLOW"
    held = await held_in_postgres(pg_dsn)
    await server.rt.redis.execute_command("REPLICAOF", "127.0.0.1", "1")  # no such primary: it stays read-only
    answers = await asyncio.gather(*(server.client.post("/v1/admissions", json=body(f"ro-{i}")) for i in range(5)))
    assert [a.status_code for a in answers] == [503] * 5, [a.text for a in answers]
    assert all("ReadOnlyError" in a.json()["detail"] for a in answers)
    assert await held_in_postgres(pg_dsn) == held
    await server.rt.redis.execute_command("REPLICAOF", "NO", "ONE")
    await wait_for(lambda: ready(server), what="admission ready once Redis takes writes")
    again = await server.client.post("/v1/admissions", json=body("ro-0"))
    assert again.status_code == 200 and again.json()["decision"] == "ALLOW"
    assert await reserved_in_redis(server) == await held_in_postgres(pg_dsn) == {next(iter(held)): 16 * GPU_HOUR}


async def test_a_redis_that_lost_an_acknowledged_write_is_caught_by_the_number_it_hands_out_again(admission_factory, pg_dsn, monkeypatch) -> None:
    # Batch X reserves (sequence s+1) and Redis loses that write, as a failover to a replica that
    # never got it does: Redis is back at s without X's reservation. Batch Z read the highest
    # committed number (s) before X committed, so that Redis passes for current; it gets s+1
    # again. Both used to commit s+1: Redis then matched Postgres by number while it lacked X's
    # reservation, and the next submissions were admitted into room X holds.
    from budgetgate.services.admission import records

    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("seq", limit="gpu_hours: 24")}, sha="f" * 40)
    server = await admission_factory()
    await server.wait_ready()
    assert decision_of(await server.client.post("/v1/admissions", json=body("seq-a"))) == "ALLOW"
    record = records.record
    x_lost, z_reserved = asyncio.Event(), asyncio.Event()
    calls: list[list[str]] = []
    numbers: list[int | None] = []

    async def choreographed(conn, batch):  # type: ignore[no-untyped-def]
        calls.append([r.request.run_id for r in batch])
        numbers.extend(r.ledger_seq for r in batch)
        ledger = server.rt.ledger
        if len(calls) == 1:  # X, reserved: its write is lost in a failover
            [x] = batch
            assert x.ledger_seq is not None
            assert await ledger.release(x.request.run_id, decision_id=x.body["decision_id"]) > 0
            await ledger.client.set(ledger.sequence, x.ledger_seq - 1)
            x_lost.set()
            await z_reserved.wait()
        elif len(calls) == 2:  # Z, reserved on that Redis
            z_reserved.set()
        await record(conn, batch)

    monkeypatch.setattr(records, "record", choreographed)
    x = asyncio.create_task(server.client.post("/v1/admissions", json=body("seq-x")))
    await asyncio.wait_for(x_lost.wait(), 30)
    z = await server.client.post("/v1/admissions", json=body("seq-z"))
    x_answer = await x
    monkeypatch.setattr(records, "record", record)
    # One of the two commits failed on the reused number; its batch was decided again on a Redis
    # rebuilt from Postgres. Both fit (24 GPU-hours: 8 each), and the budget is now full.
    assert (x_answer.status_code, z.status_code) == (200, 200), (x_answer.text, z.text)
    assert (x_answer.json()["decision"], z.json()["decision"]) == ("ALLOW", "ALLOW")
    held = await held_in_postgres(pg_dsn)
    assert list(held.values()) == [24 * GPU_HOUR]
    assert await reserved_in_redis(server) == held
    assert decision_of(await server.client.post("/v1/admissions", json=body("seq-w"))) == "DENY"
    assert await held_in_postgres(pg_dsn) == held
    assert len(calls) == 3 and numbers[0] == numbers[1], (calls, numbers)  # Z got X's number; one was decided again


async def test_sweeper_releases_orphans_and_keeps_real_holds(admission_factory, pg_dsn) -> None:
    from datetime import UTC, datetime, timedelta

    from budgetgate.ledger.redis_ledger import ChargeRequest

    await apply_policies(pg_dsn, {"b.yaml": LIMIT}, sha="d" * 40)
    server = await admission_factory(orphan_grace_seconds=3600)
    await server.wait_ready()
    assert decision_of(await server.client.post("/v1/admissions", json=body("real"))) == "ALLOW"
    [key] = (await held_in_postgres(pg_dsn)).keys()
    old = int((datetime.now(UTC) - timedelta(hours=2)).timestamp() * 1000)
    for name, at in (("old-orphan", old), ("young-orphan", int(datetime.now(UTC).timestamp() * 1000))):
        result = await server.rt.ledger.reserve(
            run_id=name, decision_id=str(uuid.uuid4()), charges=[ChargeRequest(key, 8 * GPU_HOUR, 100 * GPU_HOUR, True)], now_ms=at
        )
        assert result.status == "RESERVED"
    released = await server.rt.sync.sweep_orphans(grace=timedelta(minutes=10), now=datetime.now(UTC))
    assert released == ["old-orphan"]
    # The real run and the orphan still inside its grace period keep their holds.
    assert await reserved_in_redis(server) == {key: 16 * GPU_HOUR}
    assert set(await server.rt.ledger.held_runs()) == {"run-real", "young-orphan"}
    # With no grace at all, only holds without a committed decision go.
    assert await server.rt.sync.sweep_orphans(grace=timedelta(0), now=datetime.now(UTC)) == ["young-orphan"]
    assert await reserved_in_redis(server) == {key: 8 * GPU_HOUR}
    assert set(await server.rt.ledger.held_runs()) == {"run-real"}


async def test_sweeper_never_releases_a_hold_it_cannot_name(admission_factory, pg_dsn) -> None:
    """A run key read while a rebuild rewrites it (or gone between SCAN and HMGET) names no
    decision; the sweeper once released such a hold as "any decision's", and the reconciler's
    settlement of the same committed run then released it again (the ledger went negative)."""
    await apply_policies(pg_dsn, {"b.yaml": LIMIT}, sha="e" * 40)
    server = await admission_factory(orphan_grace_seconds=3600)
    await server.wait_ready()
    assert decision_of(await server.client.post("/v1/admissions", json=body("real"))) == "ALLOW"
    [key] = (await held_in_postgres(pg_dsn)).keys()
    ledger = server.rt.ledger
    before = await reserved_in_redis(server)
    # The real run's key as a half-written one: its amounts without its decision and time.
    await ledger.client.hdel(ledger.run("run-real"), "_decision", "_at")
    assert "run-real" not in await ledger.held_runs()
    assert await server.rt.sync.sweep_orphans(grace=timedelta(0), now=datetime.now(UTC)) == []
    assert await reserved_in_redis(server) == before == {key: 8 * GPU_HOUR}


async def test_a_drift_repair_and_the_orphan_sweep_give_an_orphan_back_once(admission_factory, pg_dsn) -> None:
    """An admission process died between its Redis reservation and its commit: the drift check
    finds the key above Postgres and repairs it, and the sweeper later releases the orphan. A
    key repaired in place to Postgres's figure gave the orphan back twice (the room went below
    what Postgres holds)."""
    from budgetgate.ledger.redis_ledger import ChargeRequest

    await apply_policies(pg_dsn, {"b.yaml": LIMIT}, sha="f" * 40)
    server = await admission_factory(orphan_grace_seconds=3600)
    await server.wait_ready()
    assert decision_of(await server.client.post("/v1/admissions", json=body("real"))) == "ALLOW"
    [key] = (await held_in_postgres(pg_dsn)).keys()
    orphan = await server.rt.ledger.reserve(
        run_id="orphan", decision_id=str(uuid.uuid4()), charges=[ChargeRequest(key, 8 * GPU_HOUR, 100 * GPU_HOUR, True)], now_ms=0
    )
    assert orphan.status == "RESERVED" and await reserved_in_redis(server) == {key: 16 * GPU_HOUR}
    drift = await server.rt.sync.check_drift(repair=True)
    assert drift is not None and set(drift.keys) == {key} and drift.repaired
    await server.rt.sync.sweep_orphans(grace=timedelta(0), now=datetime.now(UTC))
    assert await reserved_in_redis(server) == await held_in_postgres(pg_dsn) == {key: 8 * GPU_HOUR}
    assert (await server.rt.sync.check_drift(repair=False)).clean  # type: ignore[union-attr]


async def test_redis_restored_from_an_old_snapshot_is_rebuilt_and_never_over_admits(admission_factory, killable_redis, pg_dsn) -> None:
    # The repro of the over-admission: 25 ALLOW, SAVE, 25 more ALLOW, Redis restarted with the
    # same arguments loads the old dump.rdb (its "loaded" marker included), 100 more submissions.
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("snap", limit="gpu_hours: 50")}, sha="5" * 40)
    server = await admission_factory(redis_url=killable_redis.url, pg_pool_max=30)
    await server.wait_ready()

    def one(i: int | str) -> dict[str, object]:
        return submission(run_id=f"snap-{i}", labels={"team": "vision"}, resources={"gpus": 1}, projected_runtime_hours=1.0)

    first = await asyncio.gather(*(server.client.post("/v1/admissions", json=one(i)) for i in range(25)))
    assert [a.json()["decision"] for a in first] == ["ALLOW"] * 25
    assert await server.rt.redis.save()
    second = await asyncio.gather(*(server.client.post("/v1/admissions", json=one(i)) for i in range(25, 50)))
    assert [a.json()["decision"] for a in second] == ["ALLOW"] * 25

    await restart_from_snapshot(killable_redis, server)
    # The restored Redis carries the marker and the first 25 reservations only.
    restored = aioredis.from_url(killable_redis.url)
    try:
        ledger = server.rt.ledger
        assert await restored.exists(ledger.marker)
        assert await restored.hget(ledger.ledger(next(iter(await held_in_postgres(pg_dsn)))), "reserved") == str(25 * GPU_HOUR).encode()
    finally:
        await restored.aclose()

    answers = await asyncio.gather(*(server.client.post("/v1/admissions", json=one(i)) for i in range(50, 150)))
    assert {a.status_code for a in answers} <= {200, 503}
    assert sum(a.status_code == 200 and a.json()["decision"] == "ALLOW" for a in answers) == 0
    held = await held_in_postgres(pg_dsn)
    assert list(held.values()) == [50 * GPU_HOUR]
    assert await reserved_in_redis(server) == held


async def test_redis_lost_between_the_reserve_and_the_commit(admission_factory, killable_redis, pg_dsn, monkeypatch) -> None:
    from budgetgate.services.admission import records

    await apply_policies(pg_dsn, {"b.yaml": LIMIT}, sha="6" * 40)
    server = await admission_factory(redis_url=killable_redis.url)
    await server.wait_ready()
    assert decision_of(await server.client.post("/v1/admissions", json=body("before"))) == "ALLOW"
    record = records.record

    async def record_after_losing_redis(conn, batch):  # type: ignore[no-untyped-def]
        if killable_redis.running:
            killable_redis.stop()  # Redis reserved for the batch and is gone before the commit
        await record(conn, batch)

    monkeypatch.setattr(records, "record", record_after_losing_redis)
    answers = await one_batch(server, [body(f"lost-{i}") for i in range(3)])
    monkeypatch.setattr(records, "record", record)
    # Postgres committed the batch, so its answers stand: durable before acknowledged.
    assert [a["decision"] for a in answers] == ["ALLOW"] * 3
    killable_redis.start()  # empty: rebuilt from Postgres, the batch's reservations included
    after = await asyncio.gather(*(server.client.post("/v1/admissions", json=body(f"after-{i}")) for i in range(12)))
    assert {a.status_code for a in after} <= {200, 503}

    # A 503 (a pooled connection to the old Redis, the rebuild under way) fails closed and is
    # retried by its client, as any would; answered, exactly the room Postgres leaves is allowed.
    async def all_answered() -> bool:
        again = [i for i, a in enumerate(after) if a.status_code == 503]
        for i, answer in zip(again, await asyncio.gather(*(server.client.post("/v1/admissions", json=body(f"after-{i}")) for i in again)), strict=True):
            after[i] = answer
        return all(a.status_code != 503 for a in after)

    await wait_for(all_answered, timeout=30, interval=0.1, what="every submission refused with 503 answered when retried")
    got = [(a.status_code, a.json().get("decision") or a.json().get("detail")) for a in after]
    assert sum(a.status_code == 200 and a.json()["decision"] == "ALLOW" for a in after) == 12 - 4, got
    held = await held_in_postgres(pg_dsn)
    assert list(held.values()) == [96 * GPU_HOUR]
    assert await reserved_in_redis(server) == held


async def test_redis_restored_from_before_a_settlement_is_rebuilt_and_never_over_admits(admission_factory, killable_redis, pg_dsn) -> None:
    # A run reserved 8 GPU-hours and used 40: its settlement took 32 more from the budget than the
    # decision had. Redis restored from a snapshot taken between the two carries the decision's
    # ledger sequence (the highest any decision recorded) and none of the settlement; deciding on
    # it offered 40 GPU-hours that were gone.
    await apply_policies(pg_dsn, {"b.yaml": budget_yaml("settled", limit="gpu_hours: 50")}, sha="7" * 40)
    server = await admission_factory(redis_url=killable_redis.url)
    await server.wait_ready()
    over = submission(run_id="over", labels={"team": "vision"}, resources={"gpus": 8}, projected_runtime_hours=1.0)
    assert decision_of(await server.client.post("/v1/admissions", json=over)) == "ALLOW"
    assert await server.rt.redis.save()

    start = this_month(timedelta(hours=6))
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    try:
        await pool.execute(
            "INSERT INTO lifecycle_events (event_id, run_id, kind, event_time) VALUES ('over-s', 'over', 'STARTED', $1), ('over-c', 'over', 'COMPLETED', $2)",
            start,
            start + timedelta(hours=5),
        )
        await pool.execute(
            "INSERT INTO run_samples (run_id, sample_id, observed_at, gpu, node) VALUES ('over', 'x', $1, $2, 0)", start + timedelta(hours=5), 40 * GPU_HOUR
        )
        bundles = PolicyStore()
        async with pool.acquire() as conn:
            await bundles.refresh(conn)
        settler = Settler(pool=pool, ledgers=server.rt.ledgers, bundles=bundles, rules=Rules())
        assert (await settler.settle("over")).changed
        committed = await pool.fetchval("SELECT budgetgate_committed_ledger_seq()")
        decided = await pool.fetchval("SELECT max(ledger_seq) FROM decisions")
        consumed = await pool.fetchval("SELECT consumed FROM ledger_entries")
    finally:
        await pool.close()
    assert (await held_in_postgres(pg_dsn), consumed) == ({}, 40 * GPU_HOUR)
    assert committed > decided  # the settlement recorded the number its increase took

    await restart_from_snapshot(killable_redis, server)
    restored = aioredis.from_url(killable_redis.url)
    try:
        assert await restored.exists(server.rt.ledger.marker)
        assert int(await restored.get(server.rt.ledger.sequence)) == decided
    finally:
        await restored.aclose()

    answers = []
    for i in range(10):
        asked = submission(run_id=f"after-{i}", labels={"team": "vision"}, resources={"gpus": 1}, projected_runtime_hours=4.0)
        answers.append(await server.client.post("/v1/admissions", json=asked))
    assert {a.status_code for a in answers} <= {200, 503}
    allowed = sum(a.status_code == 200 and a.json()["decision"] == "ALLOW" for a in answers)
    assert allowed == 2  # 10 GPU-hours were left: two of 4, never the 40 the snapshot showed
    held = await held_in_postgres(pg_dsn)
    assert sum(held.values()) == 8 * GPU_HOUR
    assert await reserved_in_redis(server) == held


async def test_redis_restored_from_before_a_pool_grant_is_rebuilt_and_never_grants_past_the_quota(admission_factory, killable_redis, pg_dsn) -> None:
    pools = """apiVersion: budgetgate/v1
kind: ResourcePool
metadata: {id: warehouse}
spec: {namespace: "snowflake:wh-1", quota: 1}
"""
    await apply_policies(pg_dsn, {"p.yaml": pools}, sha="8" * 40)
    server = await admission_factory(redis_url=killable_redis.url)
    await server.wait_ready()
    url = "/v1/pools/snowflake:wh-1/allocations"
    assert await server.rt.redis.save()
    assert (await server.client.post(url, json={"token": "a0", "project": "alpha"})).json()["status"] == "Granted"
    for _ in range(2):  # renewed: the marks of the grant are pruned, so only the check can tell
        assert (await server.client.post(url, json={"token": "a0", "project": "alpha"})).json()["renewed"]
    await server.rt.pool.execute("DELETE FROM ledger_marks WHERE ledger_seq < (SELECT max(ledger_seq) FROM ledger_marks)")

    await restart_from_snapshot(killable_redis, server)  # the snapshot holds no token

    answers = [await server.client.post(url, json={"token": f"b{i}", "project": "beta"}) for i in range(3)]
    assert {a.status_code for a in answers} <= {200, 503}
    assert all(a.json()["status"] != "Granted" for a in answers if a.status_code == 200)
    assert any(a.status_code == 200 for a in answers)


async def test_pruning_the_ledger_marks_keeps_the_highest_the_check_reads(pg_dsn) -> None:
    conn = await asyncpg.connect(pg_dsn)
    try:
        for seq in (5, 9, 7, 69, 133, 73):  # 69 and 133 ≡ 5, 73 ≡ 9 (mod 64): one shard's each
            assert await conn.fetchval(sql("record_ledger_mark"), seq) == 1
        assert await conn.fetchval(sql("record_ledger_mark"), 7) is None  # handed out twice
        await conn.execute(sql("prune_ledger_marks"))
        # The highest of each shard's residue stays (budgetgate.core.shards): the highest of all
        # for one shard, and each shard's own when there are several.
        assert [r["ledger_seq"] for r in await conn.fetch("SELECT ledger_seq FROM ledger_marks ORDER BY 1")] == [7, 73, 133]
        assert await conn.fetchval("SELECT budgetgate_committed_ledger_seq()") == 133
        assert [await conn.fetchval(sql("committed_shard_seq"), shard, 64) for shard in (5, 7, 9, 11)] == [133, 7, 73, 0]
    finally:
        await conn.close()


SHARDED_POOL = """apiVersion: budgetgate/v1
kind: ResourcePool
metadata: {id: warehouse}
spec: {namespace: "snowflake:wh-1", quota: 1}
"""


def _with_token(tenant: str, n: int) -> dict[str, object]:
    return {**sharded_run(tenant, n), "pool_token": {"namespace": "snowflake:wh-1"}}


async def test_a_pool_token_taken_apart_goes_back_when_its_batch_fails_to_commit(admission_factory, pg_dsn, monkeypatch) -> None:
    """On three shards a run's token is granted on the pools' shard before its decision is
    written; the write fails: the token is not left held in Redis with no row in Postgres (the
    pools' shard is invalidated with the batch's, and rebuilt), so the pool's one token goes to
    the next run."""
    from budgetgate.services.admission import records

    await apply_policies(pg_dsn, {**sharded_policies(), "p.yaml": SHARDED_POOL}, sha="6" * 40)
    server = await admission_factory(ledger_shards=SHARDS)
    await server.wait_ready()
    tenant = next(t for t in TENANTS if server.rt.ledgers.of_root(t) is not server.rt.ledgers.of_root(""))  # another shard than the pools'
    record = records.record

    async def write_lost(conn, batch):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("Postgres went away before the batch's write")

    monkeypatch.setattr(records, "record", write_lost)
    failed = await server.client.post("/v1/admissions", json=_with_token(tenant, 0))
    monkeypatch.setattr(records, "record", record)
    assert failed.status_code == 503, failed.text
    pools = server.rt.ledgers.of_root("")
    assert await pools.client.zcard(pools.keys.pool("snowflake:wh-1")[0]) == 0 or not await pools.is_loaded()

    async def answered(body: dict[str, object]) -> str | None:  # (a 503 while the shards are rebuilt is retried, as any client would)
        answer = await server.client.post("/v1/admissions", json=body)
        return None if answer.status_code == 503 else decision_of(answer)

    assert await wait_for(lambda: answered(_with_token(TENANTS[5], 0)), timeout=30, interval=0.1, what="an answer") == "ALLOW"
    assert await wait_for(lambda: answered(_with_token(tenant, 0)), timeout=30, interval=0.1, what="an answer") == "DENY"  # the pool is full
    assert await server.rt.pool.fetchval("SELECT array_agg(token) FROM pool_allocations WHERE state = 'held'") == [f"run:{TENANTS[5]}/run-0"]
    assert await held_in_redis(server) == await held_in_postgres(pg_dsn)
    assert all([(await sync.check_drift(repair=False)).clean for sync in server.rt.ledgers.syncs])


async def test_the_pools_shard_restored_from_before_a_runs_token_is_rebuilt_and_never_grants_it_again(admission_factory, killable_redis, pg_dsn) -> None:
    """A run's token taken apart advances the pools' shard's ledger sequence, and Postgres records
    it with the decision (a ledger mark): a pools' shard restored from a snapshot taken before
    the grant is behind, rebuilt before it decides, and the pool's one token is not granted to
    another run. The run's tenant is on another shard, whose decisions are not the pools'
    shard's: without the mark nothing would tell the restored shard is behind."""
    await apply_policies(pg_dsn, {**sharded_policies(), "p.yaml": SHARDED_POOL}, sha="6" * 40)
    server = await admission_factory(redis_url=killable_redis.url, ledger_shards=SHARDS)
    await server.wait_ready()
    pools = server.rt.ledgers.of_root("")
    holder, other = [t for t in TENANTS if server.rt.ledgers.of_root(t) is not pools][:2]
    assert await pools.client.save()
    assert decision_of(await server.client.post("/v1/admissions", json=_with_token(holder, 0))) == "ALLOW"

    await restart_from_snapshot(killable_redis, server)  # the snapshot holds no token

    async def answered() -> dict:  # type: ignore[type-arg]
        answer = await server.client.post("/v1/admissions", json=_with_token(other, 0))
        return answer.json() if answer.status_code == 200 else {}

    refused = await wait_for(answered, timeout=30, interval=0.2, what="the submission answered once the shards are rebuilt")
    assert refused["decision"] == "DENY" and 'token pool "snowflake:wh-1" is exhausted (used: 1, quota: 1)' in refused["reason"], refused
    assert await pools.client.zrange(pools.keys.pool("snowflake:wh-1")[0], 0, -1) == [f"run:{holder}/run-0".encode()]
    # The holder's shard, restored too, is rebuilt at its next decision: then every shard is as Postgres.
    assert decision_of(await server.client.post("/v1/admissions", json=sharded_run(holder, 1))) == "ALLOW"
    drifts = [await sync.check_drift(repair=False) for sync in server.rt.ledgers.syncs]
    assert all(drift is not None and drift.clean for drift in drifts), drifts
