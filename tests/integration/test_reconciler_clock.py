"""Deadlines are judged on Postgres's clock, the one every recorded time was taken on. Found by the
fault campaign (`budgetgate chaos run --seed 7 --fault clock-skew`): a reconciler whose own clock
ran 90 s ahead gave reservations back as "not running within the start deadline" about 2 s after
admission, admission gave the room to others, the released runs then started and were charged,
and budgets went over their limits."""

from __future__ import annotations

import time
from datetime import datetime, timedelta

import asyncpg
import pytest

from budgetgate.services.reconciler import service as reconciler_service
from budgetgate.services.reconciler import settler as reconciler_settler
from tests.support.reconciler import reconciler_factory  # noqa: F401 - pytest fixtures
from tests.support.waiting import wait_for

DEADLINE = 4.0  # seconds to start


class Ahead(datetime):
    """This process's clock, 90 s ahead of the machine's (faketime +90s, as the campaign ran it)."""

    @classmethod
    def now(cls, tz=None):  # type: ignore[no-untyped-def, override]
        return datetime.now(tz) + timedelta(seconds=90)


async def held(dsn: str, run_id: str) -> set[str]:
    conn = await asyncpg.connect(dsn)
    try:
        return {r["state"] for r in await conn.fetch("SELECT state FROM reservations WHERE run_id = $1", run_id)}
    finally:
        await conn.close()


async def test_seed_7_a_reconciler_clock_ahead_gives_no_hold_back_before_its_start_deadline(  # type: ignore[no-untyped-def]
    admission, reconciler_factory, pg_dsn, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(reconciler_settler, "datetime", Ahead)
    monkeypatch.setattr(reconciler_service, "datetime", Ahead)
    answer = (await admission.submit(run_id="seed-7")).json()
    assert answer["decision"] == "ALLOW"
    admitted = time.monotonic()
    reconciler = await reconciler_factory(start_deadline_seconds=DEADLINE)
    assert abs(reconciler.settler.clock_offset + timedelta(seconds=90)) < timedelta(seconds=2)  # measured before the first settlement
    ticks = reconciler.stats.upkeep_ticks
    await wait_for(lambda: reconciler.stats.upkeep_ticks >= ticks + 3, what="three upkeep passes")
    if time.monotonic() - admitted < DEADLINE - 0.5:
        assert await held(pg_dsn, "seed-7") == {"held"}  # passes over its reservations before the deadline kept them

    async def released() -> bool:
        return await held(pg_dsn, "seed-7") == {"released"}

    await wait_for(released, timeout=30, what="the never-started run given back at its start deadline")
    assert time.monotonic() - admitted >= DEADLINE - 0.5  # not before it, by the machine's clock
