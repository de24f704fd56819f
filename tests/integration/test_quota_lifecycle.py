"""Quota counts and pool tokens go down when the reconciler sees runs end, or never start."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from tests.integration.test_quotas import BIG_BUDGET, POOLS, QUOTA, physics, started
from tests.integration.test_reconciler import feed, lifecycle, reconciler_factory, wait_for  # noqa: F401 - fixtures


async def test_counts_go_down_when_runs_end_or_never_start(admission_factory, reconciler_factory, feed, pg_dsn) -> None:  # noqa: F811
    files = {"q.yaml": QUOTA.format(limits="max_concurrent_allocations: 2"), "b.yaml": BIG_BUDGET, "p.yaml": POOLS.format(child=1, parent=5, cap=5)}
    server = await started(admission_factory, pg_dsn, files)
    token = {"namespace": "snowflake:wh-1", "project": "physics"}
    assert (await server.client.post("/v1/admissions", json=physics("done", pool_token=token))).json()["decision"] == "ALLOW"
    assert (await server.client.post("/v1/admissions", json=physics("idle"))).json()["decision"] == "ALLOW"
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
    assert (await server.client.post("/v1/admissions", json=physics("waiting-again"))).json()["decision"] == "ALLOW"
