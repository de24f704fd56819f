"""The set-based ingest (metering_place_batch in Postgres, the core for what it leaves) against
the core's own rules: random batches of samples with duplicates, resends under new ids, late
samples, regressions, conflicts and runs without a decision give exactly the outcomes, usage rows
and high-water marks that `assess`, applied sample after sample, gives."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import asyncpg
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from budgetgate.core.metering import Accepted, Capacity, Counters, Duplicate, MemoryUsage, Rejected, Sample, Tolerance, UsageBound
from budgetgate.services.metering_ingest import store
from budgetgate.services.metering_ingest.ingest import Ingestor, Origin, Pending
from tests.support.metering import T0, decide

TOLERANCE = Tolerance.of(0.05, slack=timedelta(minutes=5))
GRACE = timedelta(days=30)  # nothing expires while a test runs: a sample of an unknown run waits
ORIGIN = Origin(source="kafka", topic="t", payload=b"", headers=())


class _NoCounts:
    def outcome(self, *_args: object, **_kwargs: object) -> None: ...

    def rejected(self, *_args: object, **_kwargs: object) -> None: ...


@st.composite
def batches(draw: st.DrawFn) -> list[list[tuple[str, str, int, int, int]]]:
    """Batches of (run, sample id, minute, gpu, node): mostly a healthy exporter's counters (a
    function of the minute), repeated, resent under new ids and out of order; some with counters
    of their own (regressions, conflicts); run "u" never gets a decision."""
    healthy = st.builds(
        lambda run, minute, suffix: (run, f"s{minute}{suffix}", minute, 1000 * minute, 10 * minute),
        st.sampled_from(["a", "b", "u"]),
        st.integers(0, 30),
        st.sampled_from(["", "", "", "/again"]),
    )
    odd = st.tuples(st.sampled_from(["a", "b"]), st.sampled_from([f"s{m}" for m in range(8)]), st.integers(0, 30), st.integers(0, 30_000), st.integers(0, 300))
    samples = draw(st.lists(st.one_of(healthy, healthy, healthy, odd) if draw(st.booleans()) else healthy, max_size=60))
    cuts = sorted(draw(st.lists(st.integers(0, len(samples)), max_size=5)))
    return [samples[a:b] for a, b in zip([0, *cuts], [*cuts, len(samples)], strict=True)]


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(batches=batches())
def test_set_based_ingest_gives_what_the_core_gives_sample_after_sample(pg_dsn: str, batches: list[list[tuple[str, str, int, int, int]]]) -> None:
    asyncio.run(_compare(pg_dsn, batches))


async def _compare(dsn: str, batches: list[list[tuple[str, str, int, int, int]]]) -> None:
    tag = uuid.uuid4().hex[:8]  # each example its own runs in the one database
    run = {name: f"{tag}-{name}" for name in ("a", "b", "u")}
    await decide(dsn, run["a"], run["b"])
    ingestor = Ingestor(max_skew=timedelta(minutes=5), grace=GRACE, counts=_NoCounts())
    reference = MemoryUsage()
    conn = await asyncpg.connect(dsn)
    try:
        for raw in batches:
            batch = [Sample(run[r], sid, T0 + timedelta(minutes=m), Counters(gpu, node)) for r, sid, m, gpu, node in raw]
            with _judged_in_sql() as judged:
                async with conn.transaction():
                    got = await ingestor.place_batch(conn, [(s, ORIGIN) for s in batch])
            event(f"judged in Postgres: {'all' if judged and all(judged) else 'some' if any(judged) else 'none'}")
            assert [_shape(o) for o in got] == [_shape(_expected(reference, s)) for s in batch]
        for name in ("a", "b"):
            rows = await conn.fetch(
                """SELECT sample_id, observed_at, gpu_milli_hours, node_milli_hours, gpu_milli_hours_cumulative, node_milli_hours_cumulative,
                          gpu_milli_hours_delta, node_milli_hours_delta, late FROM usage_records WHERE run_id = $1 ORDER BY observed_at""",
                run[name],
            )
            assert [(r["sample_id"], r["observed_at"], Counters(r["gpu_milli_hours"], r["node_milli_hours"])) for r in rows] == [
                (k.sample_id, k.observed_at, k.counters) for k in reference.recorded(run[name])
            ]
            state = await store.run_state(conn, run[name])
            cumulative = reference.cumulative(run[name])
            assert (state.cumulative if state else Counters()) == cumulative
            # The deltas of a run sum to its cumulative, and no late row raised it.
            assert Counters(sum(r["gpu_milli_hours_delta"] for r in rows), sum(r["node_milli_hours_delta"] for r in rows)) == cumulative
            assert all(r["gpu_milli_hours_delta"] == r["node_milli_hours_delta"] == 0 for r in rows if r["late"])
        pending = await conn.fetchval("SELECT count(*) FROM metering_pending WHERE run_id = $1", run["u"])
        assert pending == len({sid for b in batches for r, sid, *_ in b if r == "u"})
    finally:
        await conn.close()


@contextlib.contextmanager
def _judged_in_sql() -> Iterator[list[bool]]:
    """Per sample of the batch placed meanwhile, whether Postgres judged it (not the core)."""
    judged: list[bool] = []
    place = store.place_batch

    async def spy(*args: Any, **kwargs: Any) -> list[Any]:
        placed = await place(*args, **kwargs)
        judged.extend(p["outcome"] != "python" for p in placed)
        return placed

    store.place_batch = spy  # type: ignore[assignment]
    try:
        yield judged
    finally:
        store.place_batch = place  # type: ignore[assignment]


def _expected(reference: MemoryUsage, sample: Sample) -> Accepted | Duplicate | Pending | Rejected:
    if sample.run_id.endswith("-u"):
        return Pending(sample, sample.observed_at + GRACE)
    try:
        return reference.apply(sample)
    except Rejected as exc:
        return exc


def _shape(outcome: object) -> tuple[object, ...]:
    if isinstance(outcome, Rejected):
        return ("rejected", outcome.reason, str(outcome))
    if isinstance(outcome, Duplicate):
        return ("duplicate", outcome.sample, outcome.of)
    if isinstance(outcome, Pending):
        return ("pending", outcome.sample, outcome.until)
    assert isinstance(outcome, Accepted)
    return ("accepted", outcome.sample, outcome.cumulative, outcome.delta, outcome.late)


async def test_a_clean_stream_is_judged_in_postgres_alone(pg_dsn: str) -> None:
    """Repeats, resends under new ids and late samples of runs with a decision: every sample is
    judged by metering_place_batch, none left to the core (so the comparison above tests it)."""
    await decide(pg_dsn, "run-c")
    minutes = [3, 1, 2, 5, 4]
    clean = [Sample("run-c", f"c{m}", T0 + timedelta(minutes=m), Counters(1000 * m, 10 * m)) for m in minutes]
    stream = [*clean[:3], clean[0], Sample("run-c", "c2/again", clean[2].observed_at, clean[2].counters), *clean[3:]]
    conn = await asyncpg.connect(pg_dsn)
    try:
        for batch in (stream[:4], stream[4:]):
            async with conn.transaction():
                placed = await store.place_batch(conn, batch, sources=["kafka"] * len(batch), event_ids=[str(uuid.uuid4()) for _ in batch], tolerance=TOLERANCE)
            assert "python" not in {p["outcome"] for p in placed}
        outcomes = {p["idx"] - 1: p["outcome"] for p in placed}
        assert outcomes == {0: "duplicate", 1: "accepted", 2: "accepted"}
        assert [r["late"] for r in await conn.fetch("SELECT late FROM usage_records WHERE run_id = 'run-c' ORDER BY observed_at")] == [
            True,  # minutes 1 and 2 came after minute 3
            True,
            False,
            True,  # minute 4 came after minute 5
            False,
        ]
    finally:
        await conn.close()


# The usage bound on both paths: whatever the samples, none above what its run can have used
# since its earliest decision (with the tolerance) is recorded, and the others are judged as the
# core judges them sample after sample, whether Postgres or the core judged them.


@st.composite
def bounded_batches(draw: st.DrawFn) -> tuple[dict[str, tuple[int, int, int]], list[list[tuple[str, str, int, int, int]]], Tolerance, int | None]:
    """Runs "a" and "b" with a capacity (GPUs, nodes, decided at minute), batches of samples (run,
    sample id, second, gpu, node) with counters from nothing to far above their bound, many
    right at it; a tolerance; and, maybe, after which batch run "a" is decided again for more GPUs."""
    capacity = {run: (draw(st.integers(0, 8)), draw(st.integers(1, 3)), draw(st.integers(-10, 20))) for run in ("a", "b")}
    tolerance = Tolerance(draw(st.sampled_from([0, 50_000, 123_457])), draw(st.sampled_from([timedelta(0), timedelta(minutes=5), timedelta(seconds=7)])))

    @st.composite
    def one(draw: st.DrawFn) -> tuple[str, str, int, int, int]:
        run = draw(st.sampled_from(["a", "b"]))
        second = draw(st.integers(0, 40 * 60))
        gpus, nodes, minute = capacity[run]
        counters = []
        for units in (gpus, nodes):
            span = max((second - minute * 60) * 10**6 + tolerance.slack // timedelta(microseconds=1), 0)
            # The bound before a later decision for more GPUs (`allowed`), and around it.
            most = units * span * (10**6 + tolerance.ppm) // 10**9
            counters.append(draw(st.one_of(st.integers(max(most - 2, 0), most + 2), st.integers(0, 4 * most + 10), st.just(0))))
        return run, f"s{draw(st.integers(0, 30))}", second, counters[0], counters[1]

    samples = draw(st.lists(one(), max_size=50))
    cuts = sorted(draw(st.lists(st.integers(0, len(samples)), max_size=4)))
    batches = [samples[a:b] for a, b in zip([0, *cuts], [*cuts, len(samples)], strict=True)]
    return capacity, batches, tolerance, draw(st.one_of(st.none(), st.integers(0, len(batches))))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(case=bounded_batches(), one_by_one=st.lists(st.booleans(), min_size=6, max_size=6))
def test_no_sample_above_its_bound_is_recorded_on_either_path(
    pg_dsn: str, case: tuple[dict[str, tuple[int, int, int]], list[list[tuple[str, str, int, int, int]]], Tolerance, int | None], one_by_one: list[bool]
) -> None:
    asyncio.run(_compare_bounded(pg_dsn, case, one_by_one))


async def _compare_bounded(
    dsn: str, case: tuple[dict[str, tuple[int, int, int]], list[list[tuple[str, str, int, int, int]]], Tolerance, int | None], one_by_one: list[bool]
) -> None:
    capacity, batches, tolerance, readmit_after = case
    tag = uuid.uuid4().hex[:8]
    run = {name: f"{tag}-{name}" for name in ("a", "b")}
    bounds = {}
    for name, (gpus, nodes, minute) in capacity.items():
        await decide(dsn, run[name], gpus=gpus, nodes=nodes, decided_at=T0 + timedelta(minutes=minute))
        bounds[run[name]] = UsageBound(Capacity(gpus, nodes, T0 + timedelta(minutes=minute)), tolerance)
    ingestor = Ingestor(max_skew=tolerance.slack, grace=GRACE, counts=_NoCounts(), usage_tolerance=tolerance.ppm / 1_000_000)
    assert ingestor.tolerance == tolerance
    reference = MemoryUsage(bounds)
    conn = await asyncpg.connect(dsn)
    try:
        for number, raw in enumerate(batches):
            if number == readmit_after:
                # Run "a" readmitted on more GPUs, decided later: its bound is that of the most GPUs.
                gpus, nodes, minute = capacity["a"]
                await decide(dsn, run["a"], gpus=gpus + 4, nodes=nodes, decided_at=T0 + timedelta(minutes=minute + 5), attempt=2)
                bounds[run["a"]] = UsageBound(Capacity(gpus + 4, nodes, T0 + timedelta(minutes=minute)), tolerance)
                reference.set_bound(run["a"], bounds[run["a"]])
            batch = [Sample(run[r], sid, T0 + timedelta(seconds=sec), Counters(gpu, node)) for r, sid, sec, gpu, node in raw]
            expected = [_shape(_expected(reference, s)) for s in batch]
            if one_by_one[number % len(one_by_one)]:  # as HTTP ingest places them: the core, sample by sample
                got = []
                for s in batch:
                    async with conn.transaction():
                        try:
                            got.append(await ingestor.place(conn, s, ORIGIN))
                        except Rejected as exc:
                            got.append(exc)
            else:
                with _judged_in_sql() as judged:
                    async with conn.transaction():
                        got = await ingestor.place_batch(conn, [(s, ORIGIN) for s in batch])
                event(f"bounded, judged in Postgres: {'all' if judged and all(judged) else 'some' if any(judged) else 'none'}")
            event(f"impossible samples in the batch: {'some' if any(not bounds[s.run_id].allows(s) for s in batch) else 'none'}")
            assert [_shape(o) for o in got] == expected
        for name in ("a", "b"):
            rows = await conn.fetch("SELECT sample_id, observed_at, gpu_milli_hours, node_milli_hours FROM usage_records WHERE run_id = $1", run[name])
            recorded = [Sample(run[name], r["sample_id"], r["observed_at"], Counters(r["gpu_milli_hours"], r["node_milli_hours"])) for r in rows]
            assert all(bounds[run[name]].allows(s) for s in recorded)
            assert sorted((s.observed_at, s.counters) for s in recorded) == [(k.observed_at, k.counters) for k in reference.recorded(run[name])]
    finally:
        await conn.close()


_TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters=[chr(c) for c in [*range(0x20), 0x7F]]), max_size=12)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(
    samples=st.lists(
        st.tuples(_TEXT.filter(bool), _TEXT, st.integers(0, 10**9)),  # sample id, exporter, microseconds after the run's decision
        min_size=1,
        max_size=6,
        unique_by=(lambda t: t[0], lambda t: t[2]),
    )
)
def test_a_batchs_texts_and_times_arrive_as_they_were(pg_dsn: str, samples: list[tuple[str, str, int]]) -> None:
    """place_batch sends the texts of a batch joined and its times as microseconds since the
    epoch: every sample id and exporter (an empty one, alone in its batch, too) and every time to
    the microsecond is recorded as given."""
    asyncio.run(_round_trip(pg_dsn, samples))


async def _round_trip(dsn: str, samples: list[tuple[str, str, int]]) -> None:
    run = f"texts-{uuid.uuid4().hex[:8]}"
    await decide(dsn, run)
    ordered = sorted(samples, key=lambda s: s[2])
    batch = [Sample(run, sid, T0 + timedelta(microseconds=us), Counters(i + 1, i + 1), exporter) for i, (sid, exporter, us) in enumerate(ordered)]
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            placed = await store.place_batch(conn, batch, sources=["kafka"] * len(batch), event_ids=[str(uuid.uuid4()) for _ in batch], tolerance=TOLERANCE)
        rows = await conn.fetch("SELECT sample_id, exporter, observed_at FROM usage_records WHERE run_id = $1 ORDER BY observed_at, sample_id", run)
    finally:
        await conn.close()
    assert [p["outcome"] for p in placed] == ["accepted"] * len(batch)
    recorded = [(s.sample_id, s.exporter, s.observed_at) for s in batch]
    assert sorted((r["sample_id"], r["exporter"], r["observed_at"]) for r in rows) == sorted(recorded)


async def test_a_text_holding_the_separator_is_refused_before_anything_is_sent(pg_dsn: str) -> None:
    """A text with the separator the batch's texts are joined by would shift every column after
    it; validation keeps it out of samples, and place_batch refuses it should one get past."""
    conn = await asyncpg.connect(pg_dsn)
    try:
        bad = Sample("sep-run", "a\x1fb", T0, Counters(1, 1))
        with pytest.raises(ValueError, match="separator"):
            await store.place_batch(conn, [bad], sources=["kafka"], event_ids=[str(uuid.uuid4())], tolerance=TOLERANCE)
    finally:
        await conn.close()
