"""A run's end does not give the rest of its reservation back while usage metering-ingest has
accepted for it is still on its way to the reconciler. Found by the fault campaign
(`budgetgate chaos run --seed 20261131 --duration 1200 --rate 3 --fault marquez-outage --fault
kill-service --fault broker-kill --fault clock-skew --fault proxy-blackhole --fault postgres-pause`):
a sample was acknowledged by metering-ingest two seconds after the one before it, the run's
COMPLETED came next, and the reconciler, which had the first sample only (the second's usage
record still between metering-ingest's outbox and the reconciler, with a reconciler killed and
restarted meanwhile), took the first as complete metering (within the tolerance of the end) and
gave the rest of the reservation back. Admission gave that room to another run; the second
sample's usage then landed on top, and the budget held more than its limit.

The reconciler now reads when metering-ingest last accepted a sample for the run (usage_runs, in
the same Postgres): later than the last sample it folded, metering is not complete, and the
reservation stays as the upper bound until that usage arrives (or the provisional grace ends).
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import asyncpg

from tests.support.reconciler import H, feed, lifecycle, reconciler_factory, settled, usage  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for

RUN = "seed-20261131"


async def _reservations(dsn: str) -> set[tuple[str, int]]:
    """(state, amount) of the run's reservations on GPU-hour budgets (it is held on a money one too)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT state, amount FROM reservations WHERE run_id = $1 AND ledger_key LIKE '%|gpu_hours'", RUN)
    finally:
        await conn.close()
    assert rows
    return {(r["state"], r["amount"]) for r in rows}


async def _charged(dsn: str) -> set[int]:
    """What the run was charged on each GPU-hour ledger key (every such key the same usage)."""
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch("SELECT sum(amount) FROM run_charges WHERE run_id = $1 AND ledger_key LIKE '%|gpu_hours' GROUP BY ledger_key", RUN)
        return {r["sum"] for r in rows}
    finally:
        await conn.close()


async def _accepted_by_metering(dsn: str, *, observed_at: datetime, gpu: int) -> None:
    """What metering-ingest's transaction leaves for a sample it accepted: the run's high-water
    mark and the latest observation (its usage record is written to the outbox with it)."""
    conn = await asyncpg.connect(dsn)
    try:
        await conn.execute(
            """INSERT INTO usage_runs (run_id, gpu_milli_hours_cumulative, samples, latest_observed_at)
               VALUES ($1, $2, 1, $3)
               ON CONFLICT (run_id) DO UPDATE SET gpu_milli_hours_cumulative = GREATEST(usage_runs.gpu_milli_hours_cumulative, $2),
                   samples = usage_runs.samples + 1, latest_observed_at = GREATEST(usage_runs.latest_observed_at, $3)""",
            RUN,
            gpu,
            observed_at,
        )
    finally:
        await conn.close()


async def test_seed_20261131_usage_accepted_but_not_yet_folded_keeps_the_reservation_past_the_end(  # type: ignore[no-untyped-def]
    admission, reconciler_factory, feed, pg_dsn
) -> None:
    answer = (
        await admission.submit(run_id=RUN, resources={"gpus": 1, "nodes": 1, "flavor": "h100", "region": "us-east-1"}, projected_runtime_hours=4.0)
    ).json()
    assert answer["decision"] == "ALLOW"
    reserved = 4 * H
    await reconciler_factory(metering_tolerance_seconds=60, provisional_grace_seconds=600)
    end = datetime.now(UTC) - timedelta(minutes=1)
    start = end - timedelta(hours=2)
    first, second = end - timedelta(seconds=30), end - timedelta(seconds=10)
    # Both samples accepted by metering-ingest; only the first one's usage record has arrived.
    await _accepted_by_metering(pg_dsn, observed_at=first, gpu=1 * H)
    await _accepted_by_metering(pg_dsn, observed_at=second, gpu=2 * H)
    await feed.send(lifecycle(RUN, "STARTED", start, gpus=1), usage(RUN, "s0", first, 1.0), lifecycle(RUN, "COMPLETED", end))

    async def ended_seen() -> bool:
        row = await settled(pg_dsn, RUN)
        return row is not None and row["ended_at"] is not None

    await wait_for(ended_seen, timeout=30, what="the run's end settled")
    row = await settled(pg_dsn, RUN)
    assert row is not None and not row["final"]  # the first sample is within the tolerance, but one accepted after it is missing
    assert await _reservations(pg_dsn) == {("held", reserved - 1 * H)}  # the upper bound stays

    await feed.send(usage(RUN, "s1", second, 2.0))

    async def final() -> bool:
        row = await settled(pg_dsn, RUN)
        return row is not None and row["final"]

    await wait_for(final, timeout=30, what="the run settled for good once its usage arrived")
    assert {state for state, _ in await _reservations(pg_dsn)} == {"reconciled"}
    assert await _charged(pg_dsn) == {2 * H}  # the second sample's usage, charged before the rest went back


async def test_with_no_usage_in_flight_the_end_settles_the_run_at_once(admission, reconciler_factory, feed, pg_dsn) -> None:  # type: ignore[no-untyped-def]
    # The control: metering-ingest accepted nothing the reconciler lacks, so the end is final.
    answer = (
        await admission.submit(run_id=RUN, resources={"gpus": 1, "nodes": 1, "flavor": "h100", "region": "us-east-1"}, projected_runtime_hours=4.0)
    ).json()
    assert answer["decision"] == "ALLOW"
    await reconciler_factory(metering_tolerance_seconds=60, provisional_grace_seconds=600)
    end = datetime.now(UTC) - timedelta(minutes=1)
    first = end - timedelta(seconds=30)
    await _accepted_by_metering(pg_dsn, observed_at=first, gpu=1 * H)
    await feed.send(lifecycle(RUN, "STARTED", end - timedelta(hours=2), gpus=1), usage(RUN, "s0", first, 1.0), lifecycle(RUN, "COMPLETED", end))

    async def final() -> bool:
        row = await settled(pg_dsn, RUN)
        return row is not None and row["final"]

    await wait_for(final, timeout=30, what="the run settled for good at its end")
    assert {state for state, _ in await _reservations(pg_dsn)} == {"reconciled"}
    assert await _charged(pg_dsn) == {1 * H}
