"""Metering as a max-register (BUDGETGATE_METERING_FOLD, on by default): of a run's samples in one
consumed poll, those of one quarter hour are one point, one usage row and one usage record. What
must hold whatever the order, the repeats and the cut into polls: every run's cumulative, its
usage up to every quarter hour (where windows, hour buckets and rates change) and the sum of its
deltas are those of the clean stream applied sample after sample; every row is a true point of the
run; a run's records raise its cumulative in order; a poll read again writes nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import uuid
from datetime import UTC, timedelta

import asyncpg
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from budgetgate.benchmark.metering_runner import first_wrong_quarter
from budgetgate.contracts import topics
from budgetgate.contracts.topics import Topics
from budgetgate.core.metering import FOLD, Accepted, Counters, Duplicate, MemoryUsage, Rejected, Rejection, Sample, fold_start, milli, normalize
from budgetgate.messaging.publisher import Publisher
from budgetgate.services.metering_ingest.ingest import FOLDED, Ingestor, Origin
from budgetgate.v1.usage_pb2 import UsageRecord
from tests.support.metering import T0, IngestProcess, decide, fetchval, metering_factory, sample, usage_records, usage_rows  # noqa: F401 - a fixture
from tests.support.waiting import wait_for

GRACE = timedelta(days=30)
ORIGIN = Origin(source="kafka", topic="t", payload=b"", headers=())
START = fold_start(T0)  # a quarter hour


class _NoCounts:
    def outcome(self, *_args: object, **_kwargs: object) -> None: ...

    def rejected(self, *_args: object, **_kwargs: object) -> None: ...


def _point(run: str, second: int, suffix: str = "") -> Sample:
    """A healthy exporter's sample of `run` at `second` after START: counters a function of time."""
    return Sample(run, f"s{second}{suffix}", START + timedelta(seconds=second), Counters(1000 * second, 10 * second))


@st.composite
def polls(draw: st.DrawFn) -> list[list[tuple[str, int, str]]]:
    """Samples (run, second, suffix) of runs "a" and "b" over an hour and a bit, repeated, resent
    under new ids, shuffled, and cut into polls; many on or next to a quarter hour."""
    second = st.one_of(st.integers(0, 75 * 60), st.sampled_from([q * 900 + d for q in range(6) for d in (-1, 0, 1) if q * 900 + d >= 0]))
    one = st.tuples(st.sampled_from(["a", "b"]), second, st.sampled_from(["", "", "", "/again"]))
    samples = draw(st.lists(one, max_size=80))
    samples += draw(st.lists(st.sampled_from(samples), max_size=20)) if samples else []  # the very same samples again
    samples = draw(st.permutations(samples))
    cuts = sorted(draw(st.lists(st.integers(0, len(samples)), max_size=6)))
    return [samples[a:b] for a, b in zip([0, *cuts], [*cuts, len(samples)], strict=True)]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(polls=polls())
def test_folded_usage_is_the_clean_streams_at_every_quarter_hour(pg_dsn: str, polls: list[list[tuple[str, int, str]]]) -> None:
    asyncio.run(_compare(pg_dsn, polls))


async def _compare(dsn: str, polls: list[list[tuple[str, int, str]]]) -> None:
    tag = uuid.uuid4().hex[:8]
    run = {name: f"{tag}-{name}" for name in ("a", "b")}
    await decide(dsn, *run.values())
    ingestor = Ingestor(max_skew=timedelta(minutes=5), grace=GRACE, counts=_NoCounts(), fold=FOLD)
    reference = MemoryUsage()
    conn = await asyncpg.connect(dsn)
    try:
        for poll in polls:
            batch = [_point(run[r], second, suffix) for r, second, suffix in poll]
            async with conn.transaction():
                outcomes = await ingestor.place_batch(conn, [(s, ORIGIN) for s in batch])
            for s, outcome in zip(batch, outcomes, strict=True):
                reference.apply(s)  # a healthy stream: never rejected
                assert isinstance(outcome, Accepted | Duplicate), outcome
        for name in ("a", "b"):
            await _assert_the_clean_usage(conn, run[name], reference)
    finally:
        await conn.close()


async def _assert_the_clean_usage(conn: asyncpg.Connection, run_id: str, reference: MemoryUsage) -> None:
    rows = await conn.fetch(
        """SELECT sample_id, observed_at, gpu_milli_hours, node_milli_hours, gpu_milli_hours_cumulative, gpu_milli_hours_delta,
                  node_milli_hours_delta FROM usage_records WHERE run_id = $1 ORDER BY observed_at""",
        run_id,
    )
    clean = reference.recorded(run_id)
    cumulative = reference.cumulative(run_id)
    state = await conn.fetchrow("SELECT gpu_milli_hours_cumulative AS gpu, node_milli_hours_cumulative AS node FROM usage_runs WHERE run_id = $1", run_id)
    assert (Counters(state["gpu"], state["node"]) if state else Counters()) == cumulative
    points = {(k.observed_at, k.counters) for k in clean}
    # Every row is a true point of the run, one per quarter hour at most per poll, never more rows than points.
    assert all((r["observed_at"], Counters(r["gpu_milli_hours"], r["node_milli_hours"])) in points for r in rows)
    assert len(rows) <= len(clean)
    assert Counters(sum(r["gpu_milli_hours_delta"] for r in rows), sum(r["node_milli_hours_delta"] for r in rows)) == cumulative
    # Usage up to each quarter hour: its latest point before it. A point on the quarter hour starts
    # the next one, as the reconciler charges an increment to the window and bucket of its end.
    assert first_wrong_quarter(run_id, rows, reference) is None


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(polls=polls())
def test_a_poll_that_reads_only_points_and_late_samples_records_the_same(pg_dsn: str, polls: list[list[tuple[str, int, str]]]) -> None:
    """`every` false (metering-ingest's Kafka polls): Postgres answers no row for an accepted
    sample that is neither its quarter hour's point nor late, and place_batch says FOLDED for it;
    every other outcome, every usage row and every usage record are those of the poll answered in
    full."""
    asyncio.run(_compare_every(pg_dsn, polls))


async def _compare_every(dsn: str, polls: list[list[tuple[str, int, str]]]) -> None:
    tag = uuid.uuid4().hex[:8]
    full, compact = ({name: f"{tag}-{kind}-{name}" for name in ("a", "b")} for kind in ("full", "compact"))
    await decide(dsn, *full.values(), *compact.values())
    ingestor = Ingestor(max_skew=timedelta(minutes=5), grace=GRACE, counts=_NoCounts(), fold=FOLD)
    conn = await asyncpg.connect(dsn)
    folded = 0
    try:
        for poll in polls:
            answers = []
            for run, every in ((full, True), (compact, False)):
                batch = [_point(run[r], second, suffix) for r, second, suffix in poll]
                async with conn.transaction():
                    outcomes = await ingestor.place_batch(conn, [(s, ORIGIN) for s in batch], every=every)
                    records = await conn.fetch("SELECT payloads FROM outbox WHERE xmin = pg_current_xact_id()::xid AND topic = $1 ORDER BY id", topics.USAGE)
                answers.append((outcomes, [_usage_record(p, run) for r in records for p in r["payloads"]]))
            (everything, announced), (fewer, announced_fewer) = answers
            assert announced_fewer == announced
            for whole, compact_outcome in zip(everything, fewer, strict=True):
                if compact_outcome is FOLDED:
                    folded += 1
                    assert isinstance(whole, Accepted) and not whole.late, whole
                else:
                    assert _named(compact_outcome, compact) == _named(whole, full)
        for name in ("a", "b"):
            assert await _rows(conn, compact[name]) == await _rows(conn, full[name])
    finally:
        await conn.close()
    event(f"folded samples without a row: {'some' if folded else 'none'}")


def _named(outcome: object, run: dict[str, str]) -> object:
    """`outcome` with its sample's run named as in the polls ("a", "b")."""
    by_id = {v: k for k, v in run.items()}
    sample = getattr(outcome, "sample", None)
    return dataclasses.replace(outcome, sample=dataclasses.replace(sample, run_id=by_id[sample.run_id])) if sample is not None else outcome  # type: ignore[call-overload]


def _usage_record(payload: bytes, run: dict[str, str]) -> tuple[object, ...]:
    record = UsageRecord.FromString(payload)
    by_id = {v: k for k, v in run.items()}
    return (by_id[record.run_id], record.sample_id, record.observed_at.ToDatetime(), record.gpu_milli_hours_cumulative,
            record.gpu_milli_hours_delta, record.node_milli_hours_delta)  # fmt: skip


async def _rows(conn: asyncpg.Connection, run_id: str) -> list[tuple[object, ...]]:
    rows = await conn.fetch(
        """SELECT sample_id, observed_at, gpu_milli_hours, node_milli_hours, gpu_milli_hours_cumulative, node_milli_hours_cumulative,
                  gpu_milli_hours_delta, node_milli_hours_delta, late FROM usage_records WHERE run_id = $1 ORDER BY observed_at""",
        run_id,
    )
    return [tuple(r) for r in rows]


async def test_a_regression_below_a_kept_point_is_still_rejected(pg_dsn: str) -> None:
    """The fold keeps the points a later sample is judged against: a sample after a recorded
    point with lower counters is a counter_regression, as with a row per sample."""
    await decide(pg_dsn, "fold-r")
    ingestor = Ingestor(max_skew=timedelta(minutes=5), grace=GRACE, counts=_NoCounts(), fold=FOLD)
    conn = await asyncpg.connect(pg_dsn)
    try:
        async with conn.transaction():
            first = await ingestor.place_batch(conn, [(_point("fold-r", s), ORIGIN) for s in (60, 120, 180)])
        assert all(isinstance(o, Accepted) for o in first)
        assert await conn.fetchval("SELECT count(*) FROM usage_records WHERE run_id = 'fold-r'") == 1  # one quarter hour, one point
        low = Sample("fold-r", "low", START + timedelta(seconds=240), Counters(1000 * 100, 10 * 240))
        async with conn.transaction():
            [outcome] = await ingestor.place_batch(conn, [(low, ORIGIN)])
        assert isinstance(outcome, Rejected) and outcome.reason is Rejection.COUNTER_REGRESSION
        # A sample folded away, sent again: its quarter hour's point covers it, nothing is written.
        async with conn.transaction():
            [again] = await ingestor.place_batch(conn, [(_point("fold-r", 60), ORIGIN)])
        assert again == Duplicate(_point("fold-r", 60), of="s180")
        assert await conn.fetchval("SELECT count(*) FROM usage_records WHERE run_id = 'fold-r'") == 1
    finally:
        await conn.close()


async def test_a_shuffled_resent_stream_through_kafka_is_the_clean_usage_and_read_again_writes_nothing(metering_factory, settings, pg_dsn) -> None:  # noqa: F811
    topics = Topics(settings.topic_prefix)
    runs = ["fold-x", "fold-y"]
    await decide(pg_dsn, *runs)
    rng = random.Random(11)
    clean = []
    for run_id in runs:
        gpu = 0.0
        for i in range(40):  # a sample a minute for 40 minutes: three quarter hours
            gpu += rng.choice([0.0, 12.5, 60.0, 480.0])
            clean.append(sample(run_id, f"{run_id}/s{i}", gpu, at=START + timedelta(minutes=i), node_seconds=gpu / 8))
    arriving = clean + [sample(m.run_id, m.sample_id, m.gpu_seconds, at=m.observed_at.ToDatetime(tzinfo=UTC), node_seconds=m.node_seconds) for m in clean[::4]]
    rng.shuffle(arriving)
    first = await metering_factory(metering_fold=True)
    await first.wait_ready()
    async with Publisher(settings.kafka_bootstrap) as publisher:
        for message in arriving:
            await publisher.send(topics.metering, message, key=message.run_id)
    await wait_for(lambda: _consumed(first, len(arriving)), what="every sample consumed")
    reference, _ = normalize(
        Sample(m.run_id, m.sample_id, m.observed_at.ToDatetime(tzinfo=UTC), Counters(milli(m.gpu_seconds), milli(m.node_seconds))) for m in clean
    )
    conn = await asyncpg.connect(pg_dsn)
    try:
        for run_id in runs:
            await _assert_the_clean_usage(conn, run_id, reference)
    finally:
        await conn.close()
    await wait_for(lambda: _relayed(pg_dsn), what="outbox relayed")
    recorded = await usage_rows(pg_dsn)
    assert len(recorded) < len(clean)  # folded: a row per quarter hour of a run per poll
    records = await usage_records(settings.kafka_bootstrap, topics.usage, len(recorded))
    assert sorted(r.event_id for r in records) == sorted(r["event_id"] for r in recorded)  # a usage record per row
    for run_id in runs:
        mine = [r for r in records if r.run_id == run_id]
        assert sum(r.gpu_milli_hours_delta for r in mine) == reference.cumulative(run_id).gpu
        assert sum(r.node_milli_hours_delta for r in mine) == reference.cumulative(run_id).node
        assert [r.gpu_milli_hours_cumulative for r in mine] == sorted(r.gpu_milli_hours_cumulative for r in mine)
    before = (
        [dict(r) for r in await usage_rows(pg_dsn)],
        await fetchval(pg_dsn, "SELECT array_agg(row(run_id, gpu_milli_hours_cumulative, samples)::text ORDER BY run_id) FROM usage_runs"),
        await fetchval(pg_dsn, "SELECT count(*) FROM outbox"),
    )
    again = await metering_factory(metering_fold=True, consumer_group="metering-again")
    await again.wait_ready()
    await wait_for(lambda: _consumed(again, len(arriving)), what="the topic read again")
    assert again.rt.inbox.dead_lettered == 0
    after = (
        [dict(r) for r in await usage_rows(pg_dsn)],
        await fetchval(pg_dsn, "SELECT array_agg(row(run_id, gpu_milli_hours_cumulative, samples)::text ORDER BY run_id) FROM usage_runs"),
        await fetchval(pg_dsn, "SELECT count(*) FROM outbox"),
    )
    assert after == before


def _consumed(server, expected: int) -> bool:  # type: ignore[no-untyped-def]
    inbox = server.rt.inbox
    return inbox.processed + inbox.duplicates + inbox.dead_lettered >= expected


async def _relayed(dsn: str) -> bool:
    return await fetchval(dsn, "SELECT count(*) = 0 FROM outbox WHERE published_at IS NULL") is True


async def test_ingest_killed_mid_stream_with_the_fold_applies_every_sample_once(settings, pg_dsn, tmp_path) -> None:
    """metering-ingest killed while it folds a stream (an ordered stream of four runs, a sample
    every 20 s, every tenth sent twice), and the rest published while it is down: once it is
    back, each run counts every distinct sample once and its usage is the clean stream's."""
    from budgetgate.messaging.topic_admin import ensure_topics

    await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix, partitions=2)
    runs = [f"fold-k{i}" for i in range(4)]
    await decide(pg_dsn, *runs)
    topics = Topics(settings.topic_prefix)
    messages, clean = [], []
    for i in range(1200):
        run_id, step = runs[i % 4], i // 4
        # 100 minutes of samples, all in the past (a sample from the future is refused).
        message = sample(run_id, f"{run_id}/{step}", 160.0 * step, at=START - timedelta(hours=1) + timedelta(seconds=20 * step), node_seconds=20.0 * step)
        messages.append(message)
        clean.append(message)
        if i % 10 == 0:
            messages.append(message)
    ingest = IngestProcess(settings, tmp_path / "ingest.log", fold=True)
    await ingest.start()
    killed = asyncio.Event()

    async def publish() -> None:
        async with Publisher(settings.kafka_bootstrap) as publisher:
            for index, message in enumerate(messages):
                if index == 200:
                    await killed.wait()
                await publisher.send(topics.metering, message, key=message.run_id)

    applied = "SELECT coalesce(sum(samples), 0) FROM usage_runs"
    publishing = asyncio.create_task(publish())
    try:
        await wait_for(lambda: _at_least(pg_dsn, applied, 30), what="ingest under way")
        ingest.kill()
        killed.set()
        await publishing
        await ingest.start()
        await wait_for(lambda: _at_least(pg_dsn, applied, len(clean)), timeout=120, what="every sample applied after the restart")
        reference, _ = normalize(
            Sample(m.run_id, m.sample_id, m.observed_at.ToDatetime(tzinfo=UTC), Counters(milli(m.gpu_seconds), milli(m.node_seconds))) for m in clean
        )
        conn = await asyncpg.connect(pg_dsn)
        try:
            # `samples` counts applications: one applied twice would show here.
            counted = {r["run_id"]: r["samples"] for r in await conn.fetch("SELECT run_id, samples FROM usage_runs")}
            assert counted == {run_id: 300 for run_id in runs}
            for run_id in runs:
                await _assert_the_clean_usage(conn, run_id, reference)
        finally:
            await conn.close()
    finally:
        publishing.cancel()
        ingest.stop()


async def _at_least(dsn: str, query: str, count: int) -> bool:
    return int(await fetchval(dsn, query)) >= count  # type: ignore[arg-type]
