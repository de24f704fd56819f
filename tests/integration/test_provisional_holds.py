"""Provisional holds of the Kubernetes validating webhook, on a real admission service and
reconciler (Postgres, Redis, Kafka): an admission whose object no fact confirms is given back
after BUDGETGATE_PROVISIONAL_HOLD_SECONDS ("the object was never stored"), one confirmed (STORED
on workload.lifecycle.v1) is kept past it, submissions of POST /v1/admissions are not provisional,
and the rule lives in Postgres, so a reconciler started afresh keeps it."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any

import asyncpg

from tests.support.admission import held_in_postgres, reserved_in_redis
from tests.support.kubernetes import admission_review, job
from tests.support.reconciler import feed, reconciler_factory  # noqa: F401 - pytest fixtures
from tests.support.reconciler import lifecycle, wait_caught_up
from tests.support.waiting import wait_for

URL = "/v1/kubernetes/admission-review"
H100 = {"budgetgate.io/flavor": "h100"}
HOLD = 6.0  # seconds: the provisional hold the tests run with (longer than a fact takes through Kafka)


async def webhook_admits(admission, name: str) -> str:  # type: ignore[no-untyped-def]
    """A Job admitted through the webhook; its run id (the Job's UID)."""
    obj = job(name=name, gpus=8, parallelism=1, deadline=6 * 3600, annotations=H100)
    answer = await admission.client.post(URL, json=admission_review(obj))
    assert answer.status_code == 200 and answer.json()["response"]["allowed"] is True, answer.text
    return str(obj.metadata.uid)


async def reservations(dsn: str, run_id: str) -> list[dict[str, Any]]:
    conn = await asyncpg.connect(dsn)
    try:
        return [dict(r) for r in await conn.fetch("SELECT state, amount, end_reason FROM reservations WHERE run_id = $1 ORDER BY ledger_key", run_id)]
    finally:
        await conn.close()


async def provisional_runs(dsn: str) -> set[str]:
    conn = await asyncpg.connect(dsn)
    try:
        return {r["run_id"] for r in await conn.fetch("SELECT run_id FROM provisional_holds")}
    finally:
        await conn.close()


async def test_an_object_never_stored_is_given_back_and_a_stored_one_is_kept(admission, reconciler_factory, feed, pg_dsn) -> None:
    reconciler = await reconciler_factory(provisional_hold_seconds=HOLD)
    await wait_for(lambda: reconciler.consuming, what="the reconciler consuming")
    admitted_at = time.monotonic()
    never_stored = await webhook_admits(admission, "train-refused-later")
    stored = await webhook_admits(admission, "train-stored")
    api_run = (await admission.submit(run_id="exec-api")).json()
    assert api_run["decision"] == "ALLOW"
    assert await provisional_runs(pg_dsn) == {never_stored, stored}  # POST /v1/admissions holds for good
    await feed.send(lifecycle(stored, "STORED", datetime.now(UTC), event_id=f"{stored}-stored"))

    async def given_back() -> bool:
        return all(r["state"] == "released" for r in await reservations(pg_dsn, never_stored))

    await wait_for(given_back, timeout=30, what="the unconfirmed provisional hold given back")
    assert time.monotonic() - admitted_at >= HOLD
    refused = await reservations(pg_dsn, never_stored)
    assert refused and all(r["end_reason"].startswith("the object was never stored") for r in refused)
    await wait_caught_up(reconciler)
    await asyncio.sleep(HOLD)  # well past the stored run's provisional hold, and ticks of upkeep
    assert {r["state"] for r in await reservations(pg_dsn, stored)} == {"held"}, await reservations(pg_dsn, stored)
    assert {r["state"] for r in await reservations(pg_dsn, "exec-api")} == {"held"}
    assert await provisional_runs(pg_dsn) == set()  # confirmed or given back: provisional no more
    # Postgres and Redis agree on what is still held: the stored run and the API's, nothing of the refused one.
    held = await held_in_postgres(pg_dsn)
    assert held and {k: v for k, v in (await reserved_in_redis(admission)).items() if v} == held
    kept = {k: a for r in (stored, "exec-api") for k, a in await _held_by(pg_dsn, r)}
    assert sum(held.values()) == sum(kept.values())


async def _held_by(dsn: str, run_id: str) -> list[tuple[str, int]]:
    conn = await asyncpg.connect(dsn)
    try:
        return [
            (f"{run_id}|{r['ledger_key']}", r["amount"])
            for r in await conn.fetch("SELECT ledger_key, amount FROM reservations WHERE run_id = $1 AND state = 'held'", run_id)
        ]
    finally:
        await conn.close()


async def test_the_rule_survives_a_reconciler_restart(admission, reconciler_factory, feed, pg_dsn) -> None:
    # The first reconciler holds provisionally for an hour: nothing lapses before it stops.
    first = await reconciler_factory(provisional_hold_seconds=3600)
    confirmed = await webhook_admits(admission, "train-confirmed")
    unconfirmed = await webhook_admits(admission, "train-unconfirmed")
    await feed.send(lifecycle(confirmed, "STORED", datetime.now(UTC), event_id=f"{confirmed}-stored"))
    await wait_caught_up(first)
    assert await provisional_runs(pg_dsn) == {unconfirmed}  # the confirmation is recorded durably
    await first.stop()
    assert {r["state"] for r in await reservations(pg_dsn, unconfirmed)} == {"held"}
    await asyncio.sleep(HOLD)  # the next one's shorter hold has passed when it starts
    again = await reconciler_factory(provisional_hold_seconds=HOLD)

    async def given_back() -> bool:
        return all(r["state"] == "released" for r in await reservations(pg_dsn, unconfirmed))

    await wait_for(given_back, timeout=30, what="the restarted reconciler giving the unconfirmed hold back")
    await wait_caught_up(again)
    assert {r["state"] for r in await reservations(pg_dsn, confirmed)} == {"held"}
    assert all(r["end_reason"].startswith("the object was never stored") for r in await reservations(pg_dsn, unconfirmed))
