"""A sample above what its run can physically have used (its GPUs (nodes) x the time since its
earliest decision, plus the tolerance) is dead-lettered as impossible_usage with its figures and
never charged: on Kafka and over HTTP, for a sample kept pending until its run was decided, with
the capacity raised by a later decision asking for more, and for runs migration 0029 found."""

from __future__ import annotations

import json
from datetime import UTC, datetime, timedelta

import asyncpg

from budgetgate.contracts import topics as topic_names
from budgetgate.contracts import wire
from budgetgate.contracts.topics import Topics, dlq
from budgetgate.core.metering import Accepted, Capacity, Counters, Rejected, Rejection, Sample
from budgetgate.ledger.migrations import migrate, migration_files
from budgetgate.messaging.publisher import Publisher
from budgetgate.services.metering_ingest import store
from budgetgate.services.metering_ingest.ingest import Ingestor, Origin, Pending
from budgetgate.v1.metering_pb2 import MeteringSample
from tests.support.admission import admission_factory, apply_policies, budget_yaml, decision_of  # noqa: F401 - pytest fixture
from tests.support.databases import drop_database, empty_database
from tests.support.kafka import drain
from tests.support.metering import as_json, decide, dlq_reasons, fetchval, metric, sample, usage_rows
from tests.support.metering import metering, metering_factory  # noqa: F401 - pytest fixtures
from tests.support.principals import ledger_state
from tests.support.reconciler import reconciler_factory, wait_caught_up  # noqa: F401 - pytest fixture
from tests.support.waiting import wait_for

BUDGET = {"team.yaml": budget_yaml("gpu-budget/team", namespace="team-ns", labels="{team: team}", limit="gpu_hours: 50")}
# The report: a 4-GPU run, and 30 GPU-hours reported for it 30 s after its decision.
RUN = {
    "run_id": "four-gpus",
    "namespace": "team-ns",
    "labels": {"team": "team"},
    "job": {"namespace": "team-ns", "name": "train"},
    "resources": {"gpus": 4, "nodes": 1, "flavor": "h100", "region": "us-east-1"},
    "projected_runtime_hours": 1.0,
}


class _Counts:
    def __init__(self) -> None:
        self.rejections: list[Rejection] = []

    def outcome(self, *_args: object, **_kwargs: object) -> None: ...

    def rejected(self, reason: Rejection, *, source: str) -> None:
        self.rejections.append(reason)


async def test_the_reported_sample_is_dead_lettered_with_its_figures_and_charges_nothing(
    admission_factory,  # noqa: F811
    metering,  # noqa: F811
    reconciler_factory,  # noqa: F811
    settings,
    pg_dsn,
) -> None:
    await apply_policies(pg_dsn, BUDGET, sha="b" * 40)
    admission = await admission_factory()
    await admission.wait_ready()
    assert decision_of(await admission.submit(**RUN)) == "ALLOW"
    decided_at = await fetchval(pg_dsn, "SELECT decided_at FROM decisions WHERE run_id = 'four-gpus'")
    assert isinstance(decided_at, datetime)
    at = decided_at + timedelta(seconds=30)
    reconciler = await reconciler_factory()
    await wait_caught_up(reconciler)
    before = await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix)

    topics = Topics(settings.topic_prefix)
    async with Publisher(settings.kafka_bootstrap) as publisher:
        await publisher.send(topics.metering, sample("four-gpus", "s1", 30 * 3600.0, at=at, node_seconds=30.0), key="four-gpus")
    [dead] = await drain(settings.kafka_bootstrap, dlq(topics.metering), 1)
    [reason] = dlq_reasons([dead])
    assert reason == (
        f"impossible_usage: run 'four-gpus' reported 108000 GPU-seconds in sample 's1' at {at.isoformat()}, 30s after its earliest decision "
        f"({decided_at.isoformat()}); with at most 4 GPUs it can have used at most 1386 GPU-seconds by then (4 GPUs x max(0, 30s + 300s "
        "clock slack) x (1 + 0.05 tolerance)), so the sample is not charged"
    )
    # Over HTTP the same: rejected, with the reason, nothing recorded.
    answer = await metering.post(as_json(sample("four-gpus", "s2", 30 * 3600.0, at=at)))
    assert answer.status_code == 422, answer.text
    [result] = answer.json()["results"]
    assert (result["status"], result["reason"]) == ("rejected", "impossible_usage") and "108000 GPU-seconds" in result["detail"]

    text = (await metering.client.get("/metrics")).text
    assert metric(text, "budgetgate_metering_rejections_total", reason="impossible_usage", source="kafka") == 1
    assert metric(text, "budgetgate_metering_rejections_total", reason="impossible_usage", source="http") == 1
    assert await usage_rows(pg_dsn, "four-gpus") == []
    assert await fetchval(pg_dsn, "SELECT count(*) FROM outbox WHERE topic = $1", topic_names.USAGE) == 0
    await wait_caught_up(reconciler)
    # Nothing reached the reconciler, nothing moved in the ledger (Postgres and Redis).
    assert await fetchval(pg_dsn, "SELECT count(*) FROM run_samples WHERE run_id = 'four-gpus'") == 0
    assert await ledger_state(pg_dsn, settings.redis_url, settings.redis_prefix) == before

    # What 4 GPUs can have used in those 30 s is metered as ever, and reaches the reconciler.
    async with Publisher(settings.kafka_bootstrap) as publisher:
        await publisher.send(topics.metering, sample("four-gpus", "s3", 120.0, at=at, node_seconds=30.0), key="four-gpus")
    await wait_for(lambda: _has_rows(pg_dsn, "four-gpus"), what="the possible sample recorded")
    await wait_for(lambda: _reconciler_has(pg_dsn, "four-gpus"), what="the possible sample at the reconciler")
    assert [(r["sample_id"], r["gpu_milli_hours"]) for r in await usage_rows(pg_dsn, "four-gpus")] == [("s3", 120_000)]
    assert await fetchval(pg_dsn, "SELECT string_agg(sample_id || ':' || gpu, ',') FROM run_samples WHERE run_id = 'four-gpus'") == "s3:120000"


async def _has_rows(dsn: str, run_id: str) -> bool:
    return bool(await usage_rows(dsn, run_id))


async def _reconciler_has(dsn: str, run_id: str) -> bool:
    return bool(await fetchval(dsn, "SELECT count(*) FROM run_samples WHERE run_id = $1", run_id))


ORIGIN = Origin(source="kafka", topic="t", payload=b"", headers=())


async def test_a_later_decision_for_more_gpus_raises_the_bound_on_both_paths(pg_dsn: str) -> None:
    t0 = datetime.now(UTC).replace(microsecond=0) - timedelta(hours=2)
    ingestor = Ingestor(max_skew=timedelta(minutes=5), grace=timedelta(minutes=10), counts=_Counts())
    await decide(pg_dsn, "grows-batch", "grows-one", gpus=1, nodes=1, decided_at=t0)
    conn = await asyncpg.connect(pg_dsn)
    try:
        hour = t0 + timedelta(hours=1)
        for run_id in ("grows-batch", "grows-one"):
            # An hour on 1 GPU is possible; 4 GPU-hours in that hour is not.
            first, four = (
                Sample(run_id, "h1", hour, Counters(3_600_000, 3_600_000)),
                Sample(run_id, "h1x4", hour + timedelta(seconds=1), Counters(14_400_000, 3_600_000)),
            )
            async with conn.transaction():
                assert isinstance(await _place(ingestor, conn, first, batch=run_id == "grows-batch"), Accepted)
            async with conn.transaction():
                refused = await _place(ingestor, conn, four, batch=run_id == "grows-batch")
            assert isinstance(refused, Rejected) and refused.reason is Rejection.IMPOSSIBLE_USAGE, refused
            assert "with at most 1 GPUs it can have used at most 4096.05 GPU-seconds" in str(refused)  # 1 x (3601 s + 300 s) x 1.05
        # Readmitted on 8 GPUs: a decision of attempt 2. The capacity kept on the row (1 GPU) is
        # out of date, so the set-based path leaves the sample to the core, which reads the
        # decisions again, accepts it and keeps the new capacity.
        await decide(pg_dsn, "grows-batch", "grows-one", gpus=8, nodes=1, decided_at=t0 + timedelta(minutes=10), attempt=2)
        for run_id in ("grows-batch", "grows-one"):
            later = Sample(run_id, "h2", t0 + timedelta(hours=2), Counters(8 * 3_600_000, 7_200_000))
            async with conn.transaction():
                assert isinstance(await _place(ingestor, conn, later, batch=run_id == "grows-batch"), Accepted)
            state = await store.run_state(conn, run_id)
            assert state is not None and state.capacity == Capacity(8, 1, t0)  # the earliest decision stays the start
            # Above even 8 GPUs x 2 hours (and the tolerance): refused.
            impossible = Sample(run_id, "h3", t0 + timedelta(hours=2, minutes=1), Counters(20 * 3_600_000, 7_260_000))
            async with conn.transaction():
                refused = await _place(ingestor, conn, impossible, batch=run_id == "grows-batch")
            assert isinstance(refused, Rejected) and refused.reason is Rejection.IMPOSSIBLE_USAGE
            assert [r["sample_id"] for r in await usage_rows(pg_dsn, run_id)] == ["h1", "h2"]
    finally:
        await conn.close()


async def _place(ingestor: Ingestor, conn: asyncpg.Connection, sample: Sample, *, batch: bool) -> object:
    if batch:
        [outcome] = await ingestor.place_batch(conn, [(sample, ORIGIN)])
        return outcome
    try:
        return await ingestor.place(conn, sample, ORIGIN)
    except Rejected as exc:
        return exc


async def test_a_sample_kept_pending_is_judged_by_the_bound_once_its_run_is_decided(pg_dsn: str) -> None:
    now = datetime.now(UTC).replace(microsecond=0)
    counts = _Counts()
    ingestor = Ingestor(max_skew=timedelta(minutes=5), grace=timedelta(minutes=10), counts=counts)
    message = sample("undecided-yet", "p1", 30 * 3600.0, at=now - timedelta(seconds=60))
    # As HTTP ingest keeps it (services/metering_ingest/routes/samples.py).
    headers = ((wire.CONTENT_TYPE, wire.PROTOBUF.encode()), (wire.MESSAGE_TYPE, MeteringSample.DESCRIPTOR.full_name.encode()))
    origin = Origin(source="http", topic="metering.samples.v1", payload=message.SerializeToString(), headers=headers)
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    try:
        async with pool.acquire() as conn, conn.transaction():
            assert isinstance(await ingestor.place(conn, ingestor.validate(message), origin), Pending)
        # Decided 30 s before the sample was observed, for 4 GPUs: 30 GPU-hours cannot be.
        await decide(pg_dsn, "undecided-yet", gpus=4, nodes=1, decided_at=now - timedelta(seconds=90))
        assert await ingestor.recheck(pool) == 0
        assert counts.rejections == [Rejection.IMPOSSIBLE_USAGE]
        assert await usage_rows(pg_dsn, "undecided-yet") == []
        headers = await fetchval(pg_dsn, "SELECT headers::text FROM outbox WHERE topic = $1", dlq(topic_names.METERING))
        assert isinstance(headers, str)
        reason = dict(json.loads(headers))[wire.DLQ_REASON]
        assert reason.startswith("impossible_usage: run 'undecided-yet' reported 108000 GPU-seconds in sample 'p1'"), reason
        assert "30s after its earliest decision" in reason and "with at most 4 GPUs it can have used at most 1386 GPU-seconds" in reason
    finally:
        await pool.close()


async def test_migration_0029_keeps_the_capacity_of_the_runs_metering_knew(pg_dsn: str) -> None:
    name, dsn = await empty_database(pg_dsn, prefix="bound")
    try:
        conn = await asyncpg.connect(dsn)
        try:
            await migrate(conn, migrations=[(n, text) for n, text in migration_files() if n < "0029"])
            decided = datetime(2026, 1, 1, tzinfo=UTC)
            decisions = [("two-attempts", 1, 2, 1, decided), ("two-attempts", 2, 6, 2, decided + timedelta(hours=1)), ("no-count", 1, None, 1, decided)]
            await conn.executemany(
                """INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, projected_gpu, request, response, decided_at,
                                          gpus, nodes)
                   VALUES (gen_random_uuid(), $1, $2, 'ALLOW', 'test', 'ns', '{}', 0, '{}', '{}', $5, $3, $4)""",
                decisions,
            )
            await conn.executemany("INSERT INTO usage_runs (run_id) VALUES ($1)", [("two-attempts",), ("no-count",)])
            assert [n for n in await migrate(conn) if n.startswith("0029")] == ["0029_metering_usage_bound"]
            rows = await conn.fetch("SELECT run_id, max_gpus, max_nodes, first_decided_at FROM usage_runs ORDER BY run_id")
            assert [tuple(r) for r in rows] == [("no-count", None, 1, decided), ("two-attempts", 6, 2, decided)]
        finally:
            await conn.close()
    finally:
        await drop_database(pg_dsn, name)
