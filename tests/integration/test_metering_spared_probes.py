"""A sample's probe for a recorded sample of its id is spared when its id comes after every id its
run has recorded (usage_runs.max_sample_id, 0052). Every writer of usage records keeps that mark,
so a reused id is still found: a sample id recorded by a Kafka poll, by the core's batch or by a
single HTTP sample and sent again later with other figures is a conflict, as before; and a run
whose mark is unknown (NULL) has every sample probed."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta

import asyncpg
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from budgetgate.core.metering import FOLD, Counters, Rejected, Rejection, Sample
from budgetgate.services.metering_ingest.ingest import Ingestor, Origin
from tests.support.metering import T0, decide

GRACE = timedelta(days=30)
ORIGIN = Origin(source="kafka", topic="t", payload=b"", headers=())


class _NoCounts:
    def outcome(self, *_args: object, **_kwargs: object) -> None: ...

    def rejected(self, *_args: object, **_kwargs: object) -> None: ...


def _ingestor() -> Ingestor:
    return Ingestor(max_skew=timedelta(minutes=5), grace=GRACE, counts=_NoCounts(), fold=FOLD)


def _sample(run_id: str, sample_id: str, minute: int) -> Sample:
    return Sample(run_id, sample_id, T0 + timedelta(minutes=minute), Counters(1000 * minute, 10 * minute))


async def _mark(conn: asyncpg.Connection, run_id: str) -> str | None:
    return await conn.fetchval("SELECT max_sample_id FROM usage_runs WHERE run_id = $1", run_id)


async def _poll(conn: asyncpg.Connection, ingestor: Ingestor, samples: list[Sample]) -> list[object]:
    async with conn.transaction():
        return await ingestor.place_batch(conn, [(s, ORIGIN) for s in samples], every=False)


async def test_an_id_recorded_by_any_writer_and_reused_later_is_a_conflict(pg_dsn: str) -> None:
    by_poll, by_core, by_http, unknown = (f"run-{n}-{uuid.uuid4().hex[:6]}" for n in ("poll", "core", "http", "unknown"))
    await decide(pg_dsn, by_poll, by_core, by_http, unknown)
    ingestor = _ingestor()
    conn = await asyncpg.connect(pg_dsn)
    try:
        # Recorded by metering_place_batch: "s-10" is the run's last id by length, "s-9" before it.
        await _poll(conn, ingestor, [_sample(by_poll, "s-9", 1), _sample(by_poll, "s-10", 20)])
        assert await _mark(conn, by_poll) == "s-10"
        # Recorded by the core's batch: the poll holds a regression, so its run is the core's.
        outcomes = await _poll(conn, ingestor, [_sample(by_core, "c-5", 5), Sample(by_core, "c-6", T0 + timedelta(minutes=6), Counters(1, 1))])
        assert isinstance(outcomes[1], Rejected) and await _mark(conn, by_core) == "c-5"
        # Recorded by a single sample (HTTP ingest's way).
        async with conn.transaction():
            await ingestor.place(conn, _sample(by_http, "h-1", 1), ORIGIN)
        assert await _mark(conn, by_http) == "h-1"
        # A run whose mark is unknown keeps it unknown, and its samples are probed.
        await _poll(conn, ingestor, [_sample(unknown, "u-1", 1)])
        await conn.execute("UPDATE usage_runs SET max_sample_id = NULL WHERE run_id = $1", unknown)
        await _poll(conn, ingestor, [_sample(unknown, "u-2", 40)])
        assert await _mark(conn, unknown) is None

        # Each id again, later and with other counters: a conflict with the recorded sample.
        for run_id, sample_id in ((by_poll, "s-10"), (by_poll, "s-9"), (by_core, "c-5"), (by_http, "h-1"), (unknown, "u-1")):
            [outcome] = await _poll(conn, ingestor, [_sample(run_id, sample_id, 50)])
            assert isinstance(outcome, Rejected), (run_id, sample_id, outcome)
            assert outcome.reason is Rejection.CONFLICT, (run_id, sample_id, outcome)
        # A later id is new: accepted, and the mark moves on.
        [accepted] = await _poll(conn, ingestor, [_sample(by_poll, "s-100", 50)])
        assert not isinstance(accepted, Rejected) and await _mark(conn, by_poll) == "s-100"
    finally:
        await conn.close()


_IDS = st.text(alphabet=st.sampled_from("ab9Zé€𝄞-"), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(polls=st.lists(st.lists(st.tuples(st.sampled_from("xy"), _IDS, st.integers(0, 120)), max_size=12), min_size=1, max_size=5))
def test_the_mark_is_the_last_recorded_id_by_length_then_code_points(pg_dsn: str, polls: list[list[tuple[str, str, int]]]) -> None:
    """Whatever ids, in whatever order, through whichever path: each run's mark is the last of its
    recorded sample ids by length, then code point by code point (so no probe is spared for an
    id that was recorded)."""
    asyncio.run(_marks_hold(pg_dsn, polls))


async def _marks_hold(dsn: str, polls: list[list[tuple[str, str, int]]]) -> None:
    tag = uuid.uuid4().hex[:8]
    runs = {name: f"{tag}-{name}" for name in "xy"}
    await decide(dsn, *runs.values())
    ingestor = _ingestor()
    conn = await asyncpg.connect(dsn)
    try:
        for poll in polls:
            await _poll(conn, ingestor, [_sample(runs[r], sid, minute) for r, sid, minute in poll])
        for run_id in runs.values():
            recorded = [row["sample_id"] for row in await conn.fetch("SELECT sample_id FROM usage_records WHERE run_id = $1", run_id)]
            mark = await _mark(conn, run_id)
            if not recorded:
                assert mark in ("", None)  # '' once metering started the run, None before
            else:
                # By length, then code point by code point (COLLATE "C" on this UTF-8 database).
                assert mark == max(recorded, key=lambda sample_id: (len(sample_id), sample_id))
    finally:
        await conn.close()
