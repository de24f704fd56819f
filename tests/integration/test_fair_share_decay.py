"""Decayed fair share on real servers: the reconciler keeps each tenant's GPU usage decayed with
the half-life, admission answers the raw and the decayed share, and the decision is recorded
with the decayed figure it used, so explain recomputes it identically."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from budgetgate.core.decay import Decayed, decayed_share
from tests.support.admission import apply_policies
from tests.support.quotas import BIG_BUDGET, CLUSTER, QUOTA, physics, started
from tests.support.reconciler import lifecycle, usage
from tests.support.reconciler import feed, reconciler_factory  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for

HOUR = 3600.0


async def decayed_row(dsn: str, tenant: str) -> Decayed | None:
    conn = await asyncpg.connect(dsn)
    try:
        row = await conn.fetchrow("SELECT decayed_gpu, reckoned_at, half_life_seconds FROM fair_share_usage WHERE tenant = $1", tenant)
    finally:
        await conn.close()
    return None if row is None else Decayed(row["decayed_gpu"], row["reckoned_at"], timedelta(seconds=row["half_life_seconds"]))


async def test_the_answer_shows_raw_and_decayed_share_and_explains_them(admission_factory, reconciler_factory, feed, pg_dsn) -> None:  # noqa: F811
    files = {"q.yaml": QUOTA.format(limits="fair_share_target: 0.2, burst_allowance: 1.5"), "c.yaml": CLUSTER, "b.yaml": BIG_BUDGET}
    await apply_policies(pg_dsn, files, sha="9" * 40)
    server = await admission_factory(fair_share_half_life_seconds=HOUR)
    await server.wait_ready()
    first = (await server.client.post("/v1/admissions", json=physics("used", gpus=10))).json()
    assert first["fair_share"] == {
        "share": 0.0, "share_after": 0.1, "decayed_share": 0.0, "half_life_hours": 1.0, "target": 0.2, "burst_limit": 0.3, "deficit": 0.2
    }  # fmt: skip

    await reconciler_factory(fair_share_half_life_seconds=HOUR)
    end = datetime.now(UTC) - timedelta(hours=1)
    await feed.send(lifecycle("used", "STARTED", end - timedelta(hours=2), gpus=10), usage("used", "s", end, 20), lifecycle("used", "COMPLETED", end))

    async def accumulated() -> bool:
        return await decayed_row(pg_dsn, "physics") is not None

    await wait_for(accumulated, what="the tenant's decayed usage")
    row = await decayed_row(pg_dsn, "physics")
    assert row is not None and row.half_life == timedelta(hours=1)
    # 20 GPU-hours, reckoned when they were metered: an hour ago.
    assert row.at(end) == pytest.approx(20 * 3_600_000)

    async def seen() -> bool:
        quote = (await server.client.post("/v1/quotes", json=physics("quote", gpus=5))).json()
        return quote["fair_share"]["decayed_share"] > 0

    await wait_for(seen, what="admission sees the decayed usage")
    answer = (await server.client.post("/v1/admissions", json=physics("next", gpus=5))).json()
    fair = answer["fair_share"]
    decided_at = datetime.fromisoformat(answer["decided_at"])
    expected = decayed_share(row.at(decided_at), 100, timedelta(hours=1))
    # The run that used the GPUs has ended: the tenant holds nothing now, but it used 20
    # GPU-hours an hour ago, about 10 after one half-life: a decayed share of about 0.069.
    assert fair["share"] == 0.0 and fair["share_after"] == 0.05
    assert fair["decayed_share"] == pytest.approx(expected, abs=1e-6) and 0.06 < fair["decayed_share"] < 0.07
    assert fair["deficit"] == pytest.approx(0.2 - fair["decayed_share"], abs=1e-6)

    explained = (await server.client.get("/v1/admissions/next/explain")).json()
    assert explained["identical"] is True, explained["differences"]
    assert explained["recomputed"]["fair_share"] == fair


async def test_admission_without_the_reconciler_answers_no_decayed_usage_as_zero(admission_factory, pg_dsn) -> None:
    files = {"q.yaml": QUOTA.format(limits="fair_share_target: 0.2"), "c.yaml": CLUSTER, "b.yaml": BIG_BUDGET}
    server = await started(admission_factory, pg_dsn, files)
    answer = (await server.client.post("/v1/admissions", json=physics("alone", gpus=10))).json()
    assert answer["fair_share"]["decayed_share"] == 0.0 and answer["fair_share"]["half_life_hours"] == 168.0
