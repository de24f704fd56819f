"""Quota counts and pool tokens go down when the reconciler sees runs end, or never start."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg

from tests.support.admission import decision_of, submission
from tests.support.quotas import BIG_BUDGET, POOLS, QUOTA, physics, started
from tests.support.reconciler import lifecycle, wait_caught_up
from tests.support.reconciler import feed, reconciler_factory  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for


async def test_counts_go_down_when_runs_end_or_never_start(admission_factory, reconciler_factory, feed, pg_dsn) -> None:  # noqa: F811
    files = {"q.yaml": QUOTA.format(limits="max_concurrent_allocations: 2"), "b.yaml": BIG_BUDGET, "p.yaml": POOLS.format(child=1, parent=5, cap=5)}
    server = await started(admission_factory, pg_dsn, files)
    token = {"namespace": "snowflake:wh-1", "project": "physics"}
    assert decision_of(await server.client.post("/v1/admissions", json=physics("done", pool_token=token))) == "ALLOW"
    assert decision_of(await server.client.post("/v1/admissions", json=physics("idle"))) == "ALLOW"
    full = (await server.client.post("/v1/admissions", json=physics("waiting"))).json()
    assert full["reason"].startswith('allocation rejected: tenant "physics" would exceed max_concurrent_allocations quota (current: 2')

    await reconciler_factory(start_deadline_seconds=8)
    start = datetime.now(UTC) - timedelta(minutes=5)
    await feed.send(lifecycle("done", "STARTED", start, gpus=1), lifecycle("done", "COMPLETED", start + timedelta(minutes=1)))
    counter = server.rt.ledger.keys.counter("t:physics")

    async def allocations_held(n: int) -> bool:
        return int(await server.rt.ledger.client.hget(counter, "allocations") or 0) == n

    await wait_for(lambda: allocations_held(1), what="the completed run's allocation released")
    assert (await server.client.get("/v1/pools/snowflake:wh-1")).json()["used"] == 0  # its token went back too
    await wait_for(lambda: allocations_held(0), what="the never-started run's allocation released")
    assert decision_of(await server.client.post("/v1/admissions", json=physics("waiting-again"))) == "ALLOW"


async def test_holds_of_runs_no_budget_covers_end_at_the_start_deadline(admission_factory, reconciler_factory, feed, pg_dsn) -> None:  # noqa: F811
    """No budget covers these runs (unmatched submissions are allowed): each holds a quota slot or
    a pool token and no reservation. One never starts; the FAILED of another is settled before its
    decision commits (no ALLOW yet, so its mark is dropped); one holds only a token. All of them
    give back at the start deadline, and the tenant is admitted again without an operator."""
    files = {"q.yaml": QUOTA.format(limits="max_concurrent_allocations: 2"), "p.yaml": POOLS.format(child=1, parent=5, cap=5)}
    server = await started(admission_factory, pg_dsn, files)
    await reconciler_factory(start_deadline_seconds=2)
    await feed.send(lifecycle("early", "FAILED", datetime.now(UTC) - timedelta(seconds=30)))
    await wait_for(lambda: _fact_settled_undecided(pg_dsn, "early"), what="early's FAILED settled before its decision")

    assert decision_of(await server.client.post("/v1/admissions", json=physics("early"))) == "ALLOW"
    assert decision_of(await server.client.post("/v1/admissions", json=physics("idle"))) == "ALLOW"
    untenanted = submission(run_id="tok", namespace="physics", labels={}, resources={"gpus": 1}, projected_runtime_hours=1.0, job=None)
    assert decision_of(await server.client.post("/v1/admissions", json=untenanted | {"pool_token": {"namespace": "snowflake:wh-1"}})) == "ALLOW"
    full = (await server.client.post("/v1/admissions", json=physics("refused"))).json()
    assert full["reason"].startswith('allocation rejected: tenant "physics" would exceed max_concurrent_allocations quota (current: 2')
    assert (await _held(pg_dsn)) == (2, 1)  # nothing reserved on any budget: only the holds

    async def all_given_back() -> bool:
        return await _held(pg_dsn) == (0, 0)

    await wait_for(all_given_back, what="the holds of runs without reservations released at the start deadline")
    counter = await server.rt.ledger.client.hgetall(server.rt.ledger.keys.counter("t:physics"))
    assert int(counter.get(b"allocations", 0)) == 0
    assert (await server.client.get("/v1/pools/snowflake:wh-1")).json()["used"] == 0
    assert decision_of(await server.client.post("/v1/admissions", json=physics("after"))) == "ALLOW"


async def test_a_late_start_after_the_start_deadline_release_counts_on_the_quota_again(admission_factory, reconciler_factory, feed, pg_dsn) -> None:  # noqa: F811
    """Released at its start deadline, "late" starts after all while two others fill the quota
    it gave back. It counts on the quota again (three of two: over, as it runs anyway), so the
    next submission is refused on three, not admitted on two; its end gives the slot back, and
    Postgres and Redis agree throughout."""
    files = {"q.yaml": QUOTA.format(limits="max_concurrent_allocations: 2"), "b.yaml": BIG_BUDGET}
    server = await started(admission_factory, pg_dsn, files)
    reconciler = await reconciler_factory(start_deadline_seconds=2)
    assert decision_of(await server.client.post("/v1/admissions", json=physics("late"))) == "ALLOW"
    counter = server.rt.ledger.keys.counter("t:physics")

    async def allocations(n: int) -> bool:
        return int(await server.rt.ledger.client.hget(counter, "allocations") or 0) == n

    await wait_for(lambda: allocations(0), what="late's slot given back at its start deadline")
    for run_id in ("a", "b"):
        assert decision_of(await server.client.post("/v1/admissions", json=physics(run_id))) == "ALLOW"
        await feed.send(lifecycle(run_id, "STARTED", datetime.now(UTC), gpus=1))
    assert await allocations(2)

    await feed.send(lifecycle("late", "STARTED", datetime.now(UTC), gpus=1))
    await wait_for(lambda: allocations(3), what="late counted on the quota again")
    # The hold reaches Redis inside the Postgres transaction, before its commit
    # (ledger/transaction.py): Postgres shows it a moment after Redis does.
    await wait_for(lambda: _held_holds(pg_dsn, 3), what="late's hold taken again in Postgres")

    async def recorded() -> bool:
        # The holds taken again took a ledger sequence number, which Postgres records with them
        # (migration 0025): a Redis restored from before them is behind, and rebuilt.
        ledger = server.rt.ledger
        return await server.rt.pool.fetchval("SELECT budgetgate_committed_ledger_seq()") == int(await ledger.client.get(ledger.sequence))

    await wait_for(recorded, what="the late holds' ledger sequence recorded")
    await _assert_no_drift(server)
    refused = (await server.client.post("/v1/admissions", json=physics("next"))).json()
    assert refused["decision"] == "DENY"
    assert refused["reason"].startswith('allocation rejected: tenant "physics" would exceed max_concurrent_allocations quota (current: 3')

    await feed.send(lifecycle("late", "EVICTED", datetime.now(UTC)))
    await wait_for(lambda: allocations(2), what="late's slot given back when it was evicted")
    await feed.send(lifecycle("late", "READMITTED", datetime.now(UTC), gpus=1))
    await wait_for(lambda: allocations(3), what="late counted again when readmitted")
    await feed.send(lifecycle("late", "COMPLETED", datetime.now(UTC)))
    await wait_for(lambda: allocations(2), what="late's slot given back at its end")
    # As when it was taken again: Redis gives the hold back inside the Postgres transaction, before
    # its commit, so Postgres shows it released a moment after Redis does (a bare read failed CI).
    await wait_for(lambda: _held_holds(pg_dsn, 2), what="late's hold released in Postgres")
    await _assert_no_drift(server)
    # The slot it gave back stays given back: a later settlement of the ended run takes nothing.
    await feed.send(lifecycle("late", "STARTED", datetime.now(UTC) - timedelta(minutes=1), gpus=1))
    await wait_caught_up(reconciler)
    assert await allocations(2)


async def _assert_no_drift(server) -> None:  # type: ignore[no-untyped-def]
    drift = await server.rt.sync.check_drift(repair=False)
    assert drift is not None and drift.clean, drift


async def test_a_dead_lettered_run_past_the_start_deadline_waits_for_an_operator(admission_factory, reconciler_factory, feed, pg_dsn) -> None:  # noqa: F811
    """A run whose settlement is dead-lettered is not tried again at every tick by the sweep of
    never-settled runs (it was: logged each time, its dead letter's times moved); its twin, not
    dead-lettered, is given back in the same pass."""
    server = await started(admission_factory, pg_dsn, {"q.yaml": QUOTA.format(limits="max_concurrent_allocations: 5")})
    for run_id in ("dead", "twin"):
        assert decision_of(await server.client.post("/v1/admissions", json=physics(run_id))) == "ALLOW"
    conn = await asyncpg.connect(pg_dsn)
    try:
        since = datetime.now(UTC) - timedelta(hours=1)
        await conn.execute(
            "INSERT INTO settlement_failures (run_id, attempts, reason, dead, first_failed_at, last_failed_at) VALUES ('dead', 3, 'stuck', true, $1, $1)", since
        )
        await reconciler_factory(start_deadline_seconds=2)

        async def twin_given_back() -> bool:
            return await conn.fetchval("SELECT state FROM run_holds WHERE run_id = 'twin'") == "released"

        await wait_for(twin_given_back, what="the twin's hold released at the start deadline")
        # Both were past the deadline in the same sweep: the dead-lettered one was left as it was.
        assert await conn.fetchval("SELECT state FROM run_holds WHERE run_id = 'dead'") == "held"
        failure = await conn.fetchrow("SELECT attempts, dead, last_failed_at FROM settlement_failures WHERE run_id = 'dead'")
        assert (failure["attempts"], failure["dead"], failure["last_failed_at"]) == (3, True, since)
    finally:
        await conn.close()


async def _fact_settled_undecided(dsn: str, run_id: str) -> bool:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(
            "SELECT EXISTS (SELECT 1 FROM lifecycle_events WHERE run_id = $1) AND NOT EXISTS (SELECT 1 FROM runs_to_settle WHERE run_id = $1)", run_id
        )
    finally:
        await conn.close()


async def _held_holds(dsn: str, n: int) -> bool:
    return (await _held(dsn))[0] == n


async def _held(dsn: str) -> tuple[int, int]:
    """Held run holds and held pool tokens, in Postgres."""
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow(
            "SELECT (SELECT count(*) FROM run_holds WHERE state = 'held') AS holds, (SELECT count(*) FROM pool_allocations WHERE state = 'held') AS tokens"
        )
        return row["holds"], row["tokens"]
    finally:
        await conn.close()
