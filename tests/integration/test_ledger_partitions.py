"""Monthly partitions of decisions and usage records (migrations 0033, 0034): a database written
before them is moved to the partitioned layout with every row in its month and every query
answering as before; months are created ahead and rows of months without a partition kept and
then moved; a decision's keys stay unique across months; Postgres's month bounds are the Python
ones."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta, timezone

import asyncpg
import pytest

from budgetgate.core.metering import usage_event_id
from budgetgate.ledger import partitions
from budgetgate.ledger.migrations import migrate, migration_files
from budgetgate.ledger.queries import owned_by
from budgetgate.ledger.queries import sql as named
from tests.support.databases import drop_database, empty_database
from tests.support.waiting import wait_for

H = 3_600_000
SHA = "a" * 40
# Decisions before the migration: (run, attempt, outcome, decided_at, ledger_seq), months apart,
# across a year's end and in a zone east of UTC (its UTC month is the one before).
HISTORY = [
    ("jan/1", 1, "DELAY", datetime(2025, 1, 3, 8, tzinfo=UTC), None),
    ("jan/1", 2, "ALLOW", datetime(2025, 1, 31, 23, 59, 59, 999999, tzinfo=UTC), 11),
    ("feb/1", 1, "ALLOW", datetime(2025, 3, 1, 0, 30, tzinfo=timezone(timedelta(hours=2))), 12),  # 2025-02-28T22:30Z
    ("dec/1", 1, "DENY", datetime(2025, 12, 31, 12, tzinfo=UTC), None),
    ("new/1", 1, "ALLOW", datetime(2026, 1, 1, tzinfo=UTC), 13),
    ("now/1", 1, "ALLOW", None, 14),  # decided at the migration's own time: this month
]
# Usage samples before the migration: (run, sample, observed_at, cumulative GPU milli-hours), one
# run's across a month's end.
SAMPLES = [
    ("jan/1", "s1", datetime(2025, 1, 31, 23, tzinfo=UTC), 1 * H),
    ("jan/1", "s2", datetime(2025, 2, 1, 1, tzinfo=UTC), 3 * H),
    ("jan/1", "s3", datetime(2025, 2, 1, 0, 30, tzinfo=timezone(timedelta(hours=1))), 2 * H),  # 2025-01-31T23:30Z, a late one
    ("feb/1", "s1", datetime(2025, 3, 1, 0, 30, tzinfo=timezone(timedelta(hours=2))), 1 * H),
]


@pytest.fixture
async def at_0032(postgres_admin_dsn: str) -> AsyncIterator[asyncpg.Connection]:
    """A database migrated up to 0032, with decisions, evaluations, reservations, holds and
    settlements in it."""
    name, dsn = await empty_database(postgres_admin_dsn, prefix="m0033")
    conn = await asyncpg.connect(dsn)
    try:
        await migrate(conn, migrations=[m for m in migration_files() if m[0] < "0033"])
        now = await conn.fetchval("SELECT now()")
        await conn.execute(
            "INSERT INTO ledger_entries (ledger_key, scope_id, unit, window_key, window_start, window_end, policy_id, policy_git_sha, limit_amount, consumed) "
            "VALUES ('k', 'team=vision', 'gpu_hours', 'w', '2025-01-01Z', '2027-01-01Z', 'team-vision', $1, $2, $3)",
            SHA, 100 * H, 5 * H,
        )  # fmt: skip
        for run, attempt, outcome, at, seq in HISTORY:
            decision_id, at = uuid.uuid4(), at or now
            request = {"run_id": run, "attempt": attempt, "namespace": "vision", "labels": {"team": "vision"}, "resources": {"gpus": 2}}
            response = {"run_id": run, "attempt": attempt, "decision": outcome, "decision_id": str(decision_id), "decided_at": at.isoformat()}
            await conn.execute(
                "INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, job_namespace, job_name, policy_bundle_sha, "
                "projected_gpu, request, response, decided_at, ledger_seq, gpus, nodes, flavor, readings, override_revision) "
                "VALUES ($1, $2, $3, $4, 'seeded', 'vision', '{\"team\": \"vision\"}', 'vision', $2, $5, $6, $7, $8, $9, $10, 2, 1, 'h100', $11, 0)",
                decision_id, run, attempt, outcome, SHA, 2 * H, json.dumps(request), json.dumps(response), at, seq,
                json.dumps({"ledger": [{"ledger_key": "k", "limit": 100 * H, "reserved": 0, "consumed": 5 * H}]}),
            )  # fmt: skip
            await conn.execute(
                "INSERT INTO decision_evaluations (decision_id, policy_id, policy_git_sha, scope_id, ledger_key, unit, enforcement, outcome, "
                "limit_amount, projected, remaining, admitted, deficit) "
                "VALUES ($1, 'team-vision', $2, 'team=vision', 'k', 'gpu_hours', 'hard', $3, $4, $5, $6, $7, $8)",
                decision_id, SHA, outcome, 100 * H, 2 * H, 95 * H, 2 * H if outcome == "ALLOW" else 0, None if outcome == "ALLOW" else 2 * H,
            )  # fmt: skip
            if outcome == "ALLOW":
                await conn.execute(
                    "INSERT INTO reservations (run_id, ledger_key, decision_id, amount, state, expected_end) VALUES ($1, 'k', $2, $3, $4, $5)",
                    run, decision_id, 2 * H, "held" if run == "now/1" else "reconciled", at + timedelta(hours=1),
                )  # fmt: skip
                await conn.execute(
                    "INSERT INTO run_holds (run_id, decision_id, tenant, gpus, nodes, state) VALUES ($1, $2, 'vision', 2, 1, $3) "
                    "ON CONFLICT (run_id) DO NOTHING",
                    run, decision_id, "held" if run == "now/1" else "released",
                )  # fmt: skip
                await conn.execute(
                    "INSERT INTO run_settlements (run_id, decision_id, phase, final, projected_gpu) VALUES ($1, $2, $3, $4, $5) "
                    "ON CONFLICT (run_id) DO UPDATE SET decision_id = EXCLUDED.decision_id",
                    run, decision_id, "admitted" if run == "now/1" else "ended", run != "now/1", 2 * H,
                )  # fmt: skip
        for run, sample, at, cumulative in SAMPLES:
            await conn.execute(
                "INSERT INTO usage_records (run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours, gpu_milli_hours_cumulative, "
                "node_milli_hours_cumulative, gpu_milli_hours_delta, node_milli_hours_delta, late, exporter, source, event_id) "
                "VALUES ($1, $2, $3, $4, 0, $4, 0, $4, 0, false, 'test', 'http', $5)",
                run, sample, at, cumulative, usage_event_id(run, sample),
            )  # fmt: skip
        await conn.execute(
            "INSERT INTO usage_runs (run_id, gpu_milli_hours_cumulative, samples, latest_observed_at) "
            "SELECT run_id, max(gpu_milli_hours_cumulative), count(*), max(observed_at) FROM usage_records GROUP BY run_id"
        )
        yield conn
    finally:
        await conn.close()
        await drop_database(postgres_admin_dsn, name)


def _as_of_0032(query: str) -> str:
    """A shared query as it was before 0033: decisions found by their own table, evaluations by
    decision id alone."""
    return query.replace("decision_keys", "decisions").replace(" AND e.decided_at = d.decided_at", "")


# A sample's recorded neighbours as metering-ingest asked for them before 0038 (the same sample id
# by run and sample id); from 0038 on by its usage record's event id.
_NEIGHBOURS_AS_OF_0037 = """
(SELECT 'same_id' AS role, sample_id, observed_at, gpu_milli_hours, node_milli_hours FROM usage_records WHERE run_id = $1 AND sample_id = $2)
UNION ALL
(SELECT 'same_time', sample_id, observed_at, gpu_milli_hours, node_milli_hours FROM usage_records WHERE run_id = $1 AND observed_at = $3)
UNION ALL
(SELECT 'before', sample_id, observed_at, gpu_milli_hours, node_milli_hours
 FROM usage_records WHERE run_id = $1 AND observed_at < $3 ORDER BY observed_at DESC LIMIT 1)
UNION ALL
(SELECT 'after', sample_id, observed_at, gpu_milli_hours, node_milli_hours
 FROM usage_records WHERE run_id = $1 AND observed_at > $3 ORDER BY observed_at LIMIT 1)
"""
_BATCH = (["jan/1", "jan/1", "feb/1"], ["s1", "s9", "s2"], [SAMPLES[0][2], datetime(2025, 2, 15, tzinfo=UTC), datetime(2025, 3, 2, tzinfo=UTC)])
_BATCH_ORDER = "ORDER BY idx NULLS FIRST, role, run_id"


async def _neighbours(conn: asyncpg.Connection, run: str, sample: str, at: datetime, *, before: bool) -> list[dict[str, object]]:
    if before:
        return [dict(r) for r in await conn.fetch(_NEIGHBOURS_AS_OF_0037, run, sample, at)]
    query = owned_by("budgetgate.services.metering_ingest")("usage_neighbours")
    return [dict(r) for r in await conn.fetch(query, run, sample, at, usage_event_id(run, sample))]


async def _answers(conn: asyncpg.Connection, *, before: bool) -> dict[str, object]:
    """What the ledger answers about the seeded runs, through the queries that read decisions
    (`before`: as they were written before 0033)."""
    runs = sorted({run for run, *_ in HISTORY})

    def sql(name: str) -> str:
        return _as_of_0032(named(name)) if before else named(name)

    async def rows(query: str, *args: object) -> list[dict[str, object]]:
        return [dict(r) for r in await conn.fetch(query, *args)]

    return {
        "decisions": await rows("SELECT to_jsonb(d) AS row FROM decisions d ORDER BY decision_id"),
        "evaluations": await rows("SELECT to_jsonb(e) - 'decided_at' AS row FROM decision_evaluations e ORDER BY decision_id, policy_id"),
        "latest": [await rows(sql("latest_decision"), run) for run in runs],
        "inputs": [await rows(sql("decision_inputs"), run) for run in runs],
        "has": [await conn.fetchval(sql("run_has_decision"), run) for run in [*runs, "nobody"]],
        "begin": await rows(
            "SELECT run_id, decision_id, attempt, outcome, request, response, committed_seq, override_revision FROM budgetgate_begin_batch($1)", runs
        ),
        "seq": await conn.fetchval("SELECT budgetgate_committed_ledger_seq()"),
        "capacity": await rows("SELECT * FROM metering_capacity($1) ORDER BY run_id", runs),
        "denial": await rows("SELECT * FROM audit_denial_rate ORDER BY scope_id"),
        "exhaustion": await rows("SELECT * FROM audit_window_exhaustion ORDER BY ledger_key"),
        "by_sha": await rows("SELECT * FROM audit_decisions_by_policy_sha ORDER BY policy_id"),
        "usage": await rows("SELECT to_jsonb(u) AS row FROM usage_records u ORDER BY run_id, sample_id"),
        "neighbours": [await _neighbours(conn, run, sample, at, before=before) for run, sample, at, _ in SAMPLES],
        "begin_sample": await rows("SELECT * FROM metering_begin_sample('jan/1', 's9', '2025-01-31T23:45Z')"),
        "begin_batch": await rows(f"SELECT * FROM metering_begin_batch($1, $2, $3) {_BATCH_ORDER}", *_BATCH),
        "chargeback": await rows(
            f"SELECT * FROM ({owned_by('budgetgate.reports')('chargeback_metered')}) AS c ORDER BY day, gpu",
            datetime(2025, 1, 1, tzinfo=UTC),
            datetime(2026, 1, 1, tzinfo=UTC),
            [datetime(2025, 1, 1, tzinfo=UTC)],
            "team",
            "user",
            False,
        ),
        "referenced": await rows(
            "SELECT r.run_id, r.decision_id, h.decision_id AS held_by, s.decision_id AS settled_by FROM reservations r "
            "LEFT JOIN run_holds h USING (run_id) LEFT JOIN run_settlements s USING (run_id) ORDER BY r.run_id"
        ),
    }


async def test_migrations_0033_0034_move_every_row_to_its_month_and_the_queries_answer_the_same(at_0032: asyncpg.Connection) -> None:
    conn = at_0032
    before = await _answers(conn, before=True)
    assert len(before["decisions"]) == len(HISTORY) and before["seq"] == 14  # type: ignore[arg-type]
    assert await migrate(conn) == [name for name, _ in migration_files() if name >= "0033"]
    after = await _answers(conn, before=False)
    assert after == before
    # 0038: the versions that find a sample of the same id by its event id answer as the ones
    # kept for the release before.
    event_ids = [usage_event_id(run, sample) for run, sample in zip(_BATCH[0], _BATCH[1], strict=True)]
    by_event = await conn.fetch(f"SELECT * FROM metering_begin_batch($1, $2, $3, $4) {_BATCH_ORDER}", *_BATCH, event_ids)
    assert [dict(r) for r in by_event] == after["begin_batch"]
    one = await conn.fetch("SELECT * FROM metering_begin_sample('jan/1', 's9', '2025-01-31T23:45Z', $1)", usage_event_id("jan/1", "s9"))
    assert [dict(r) for r in one] == after["begin_sample"]
    assert any(r["role"] == "same_id" for r in by_event), "the batch should find a sample of the same id"

    placed = await conn.fetch("SELECT d.tableoid::regclass::text AS part, d.decided_at FROM decisions d")
    assert placed and all(r["part"] == partitions.partition_name("decisions", r["decided_at"]) for r in placed), placed
    assert "decisions_p202502" in {r["part"] for r in placed}  # 2025-03-01T00:30+02:00 is February in UTC
    evaluations = await conn.fetch(
        "SELECT e.tableoid::regclass::text AS part, e.decided_at, d.decided_at AS decided FROM decision_evaluations e JOIN decisions d USING (decision_id)"
    )
    assert len(evaluations) == len(HISTORY)
    assert all(r["decided_at"] == r["decided"] and r["part"] == partitions.partition_name("decision_evaluations", r["decided"]) for r in evaluations)
    assert await conn.fetchval("SELECT count(*) FROM decisions_default") == 0
    usage = await conn.fetch("SELECT u.tableoid::regclass::text AS part, u.observed_at FROM usage_records u")
    assert len(usage) == len(SAMPLES) and all(r["part"] == partitions.partition_name("usage_records", r["observed_at"]) for r in usage), usage
    assert {r["part"] for r in usage} == {"usage_records_p202501", "usage_records_p202502"}
    earliest = await conn.fetch(
        "SELECT r.earliest_observed_at = min(u.observed_at) AS same FROM usage_runs r JOIN usage_records u USING (run_id) GROUP BY r.run_id"
    )
    assert len(earliest) == 2 and all(r["same"] for r in earliest)  # backfilled
    keys = "decision_id, run_id, attempt, outcome, decided_at, ledger_seq"
    in_keys = await conn.fetch(f"SELECT {keys} FROM decision_keys ORDER BY decision_id")
    assert [dict(k) for k in in_keys] == [dict(r) for r in await conn.fetch(f"SELECT {keys} FROM decisions ORDER BY decision_id")]
    targets = await conn.fetch(
        "SELECT conrelid::regclass::text AS source, confrelid::regclass::text AS target FROM pg_constraint "
        "WHERE contype = 'f' AND conname LIKE '%decision_id_fkey' AND conparentid = 0 ORDER BY 1"
    )
    assert {r["source"]: r["target"] for r in targets} == {t: "decision_keys" for t in ("decision_evaluations", "reservations", "run_holds", "run_settlements")}
    # The months ahead exist, and a month without a partition (2025-06) has none made for it.
    names = {p.name for p in await partitions.partitions(conn)}
    now = await conn.fetchval("SELECT now()")
    assert {partitions.partition_name("decisions", partitions.add_months(now, n)) for n in range(4)} <= names
    assert "decisions_p202506" not in names


async def test_migration_0033_keeps_ledger_numbers_reused_before_0021(postgres_admin_dsn: str) -> None:
    # A database where two decisions recorded one ledger number (before 0021): they stay, and
    # the unique index on decision_keys covers the numbers above them, as 0021's did.
    name, dsn = await empty_database(postgres_admin_dsn, prefix="m0033")
    conn = await asyncpg.connect(dsn)
    try:
        async with conn.transaction():
            for _, text in [(n, t) for n, t in migration_files() if n < "0021"]:
                await conn.execute(text)
        for run_id, seq in (("a", 3), ("b", 5), ("c", 5)):
            await conn.execute(
                "INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, projected_gpu, request, response, decided_at, "
                "ledger_seq) VALUES (gen_random_uuid(), $1, 1, 'ALLOW', 'fits', 'ns', '{}', 8, '{}', '{}', now(), $2)",
                run_id, seq,
            )  # fmt: skip
        await conn.execute("CREATE TABLE schema_migrations (name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())")
        await conn.executemany("INSERT INTO schema_migrations (name) VALUES ($1)", [(n,) for n, _ in migration_files() if n < "0021"])
        await migrate(conn)
        indexes = dict(
            await conn.fetch("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'decision_keys' AND indexname LIKE 'decisions_ledger_seq%'")
        )
        assert indexes["decisions_ledger_seq"].startswith("CREATE UNIQUE INDEX") and indexes["decisions_ledger_seq"].endswith("WHERE (ledger_seq > 5)")
        assert "decisions_ledger_seq_reused" in indexes
        assert await conn.fetchval("SELECT count(*) FROM decisions WHERE ledger_seq = 5") == 2
        assert await conn.fetchval("SELECT budgetgate_committed_ledger_seq()") == 5
    finally:
        await conn.close()
        await drop_database(postgres_admin_dsn, name)


async def _decide(conn: asyncpg.Connection, run_id: str, at: datetime, *, attempt: int = 1, seq: int | None = None) -> uuid.UUID:
    decision_id = uuid.uuid4()
    await conn.execute(
        "INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, projected_gpu, request, response, decided_at, ledger_seq) "
        "VALUES ($1, $2, $3, 'ALLOW', 'fits', 'ns', '{}', 8, '{}', '{}', $4, $5)",
        decision_id, run_id, attempt, at, seq,
    )  # fmt: skip
    return decision_id


async def test_a_decisions_keys_are_unique_across_months_and_never_change(pg_dsn: str) -> None:
    conn = await asyncpg.connect(pg_dsn)
    try:
        await _decide(conn, "r", datetime(2024, 5, 1, tzinfo=UTC), seq=7)
        with pytest.raises(asyncpg.UniqueViolationError) as same_attempt:
            await _decide(conn, "r", datetime.now(UTC))  # another month, same run and attempt
        assert same_attempt.value.constraint_name == "decision_keys_run_attempt"
        with pytest.raises(asyncpg.UniqueViolationError) as same_number:
            await _decide(conn, "s", datetime.now(UTC), seq=7)
        assert same_number.value.constraint_name == "decisions_ledger_seq"  # what admission looks for (Redis lost writes)
        with pytest.raises(asyncpg.RaiseError, match="never change"):
            await conn.execute("UPDATE decisions SET decided_at = now() WHERE run_id = 'r'")
        await conn.execute("UPDATE decisions SET readings = '{}' WHERE run_id = 'r'")  # anything else may
        assert await conn.fetchval("SELECT count(*) FROM decision_keys") == 1
    finally:
        await conn.close()


async def test_months_are_created_ahead_and_rows_of_a_month_without_one_wait_in_the_default_partition(pg_dsn: str) -> None:
    conn = await asyncpg.connect(pg_dsn)
    try:
        long_ago = datetime(2019, 7, 14, 12, tzinfo=UTC)
        await _decide(conn, "old", long_ago)
        assert await conn.fetchval("SELECT tableoid::regclass::text FROM decisions WHERE run_id = 'old'") == "decisions_default"
        now = await conn.fetchval("SELECT now()")
        created = await partitions.ensure(conn, ahead=6)
        ahead = [partitions.partition_name(t, partitions.add_months(now, n)) for t in partitions.PARTITIONED for n in (4, 5, 6)]
        assert sorted(created) == sorted([*ahead, "decisions_p201907"])  # the evaluations' default partition held none of 2019-07
        assert await conn.fetchval("SELECT tableoid::regclass::text FROM decisions WHERE run_id = 'old'") == "decisions_p201907"
        assert await partitions.ensure(conn, ahead=6) == []  # idempotent
        found = {p.name: p for p in await partitions.partitions(conn)}
        assert (found["decisions_p201907"].start, found["decisions_p201907"].end) == (datetime(2019, 7, 1, tzinfo=UTC), datetime(2019, 8, 1, tzinfo=UTC))
        assert found["decisions_default"].default
    finally:
        await conn.close()


async def test_a_statement_waiting_on_a_months_move_out_of_the_default_partition_reads_every_row(pg_dsn: str) -> None:
    """A statement planned while the upkeep moves a month's rows out of the default partition
    waits for the move and counts them in the month's new partition: it waits on the parent's
    lock, before it is planned (0048). Locking only the default partition, it was planned with the
    partitions from before the move and counted none (a chargeback report of a month the default
    partition held answered nothing reserved)."""
    mover, reader = await asyncpg.connect(pg_dsn), await asyncpg.connect(pg_dsn)
    try:
        long_ago = datetime(2019, 7, 14, 12, tzinfo=UTC)
        for n in range(5):
            await _decide(mover, f"old-{n}", long_ago + timedelta(hours=n))
        count = "SELECT count(*) FROM decisions WHERE decided_at >= $1 AND decided_at < $2"
        bounds = (datetime(2019, 7, 1, tzinfo=UTC), datetime(2019, 8, 1, tzinfo=UTC))
        holds_the_table = (
            "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = pg_backend_pid() AND relation = 'decisions'::regclass AND mode = 'AccessExclusiveLock')"
        )
        async with mover.transaction():
            # A month with none of the default partition's rows: nothing moves, the table is not held.
            assert await mover.fetchval("SELECT budgetgate_ensure_month('decisions', $1)", datetime(2019, 8, 1, tzinfo=UTC))
            assert not await mover.fetchval(holds_the_table)
        async with mover.transaction():
            assert await mover.fetchval("SELECT budgetgate_ensure_month('decisions', $1)", long_ago)
            assert await mover.fetchval(holds_the_table)
            counting = asyncio.ensure_future(reader.fetchval(count, *bounds))  # a statement new to its connection: planned now
            await asyncio.sleep(0.5)
            assert not counting.done(), "the statement waits for the move"
        assert await counting == 5
        assert await reader.fetchval("SELECT count(*) FROM decisions_p201907") == 5
    finally:
        await mover.close()
        await reader.close()


async def test_a_row_arriving_between_the_check_and_the_lock_is_not_moved_behind_a_waiting_statements_back(pg_dsn: str) -> None:
    """The upkeep looks for the month's rows in the default partition before it locks it, and takes
    the parent's lock only when it finds some (0048). A row of the month committed in between (its
    writer held the default partition, so the upkeep's lock waited for it) would be moved without
    the parent's lock, and a statement planned meanwhile would count none of it. The upkeep looks
    again once it holds the default partition and gives up (lock_not_available, nothing changed:
    the next try takes the parent's lock first), so the statement counts the row where it is."""
    writer, mover, reader = await asyncpg.connect(pg_dsn), await asyncpg.connect(pg_dsn), await asyncpg.connect(pg_dsn)
    try:
        long_ago = datetime(2019, 7, 14, 12, tzinfo=UTC)
        count = "SELECT count(*) FROM decisions WHERE decided_at >= $1 AND decided_at < $2"
        bounds = (datetime(2019, 7, 1, tzinfo=UTC), datetime(2019, 8, 1, tzinfo=UTC))
        waits = "SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND NOT granted)"
        writing = writer.transaction()
        await writing.start()
        await _decide(writer, "late", long_ago)  # not committed yet: the upkeep's look finds nothing
        moving = asyncio.ensure_future(mover.fetchval("SELECT budgetgate_ensure_month('decisions', $1)", long_ago))
        await wait_for(lambda: writer.fetchval(waits, mover.get_server_pid()), timeout=10, what="the upkeep waiting for the default partition")
        counting = asyncio.ensure_future(reader.fetchval(count, *bounds))  # planned now, queued behind the upkeep
        await wait_for(lambda: writer.fetchval(waits, reader.get_server_pid()), timeout=10, what="the statement waiting behind the upkeep")
        await writing.commit()
        with pytest.raises(asyncpg.LockNotAvailableError, match="arrived in decisions_default"):
            await moving
        assert await counting == 1
        assert await writer.fetchval("SELECT to_regclass('decisions_p201907')") is None  # nothing changed
        assert await mover.fetchval("SELECT budgetgate_ensure_month('decisions', $1)", long_ago)  # the next try moves it, the parent locked
        assert await reader.fetchval("SELECT count(*) FROM decisions_p201907") == 1
    finally:
        for conn in (writer, mover, reader):
            await conn.close()


COMPRESSED = """SELECT c.relname, a.attname, a.attcompression FROM pg_partition_tree('decisions') t
                 JOIN pg_class c ON c.oid = t.relid JOIN pg_attribute a ON a.attrelid = t.relid
                 WHERE a.attname IN ('request', 'response', 'readings')"""


async def test_a_decisions_documents_are_compressed_with_lz4_in_every_partition_and_in_those_made_later(pg_dsn: str) -> None:
    """Migration 0042: where the server has lz4, the parent and every partition, the default
    included, and a month made afterwards, which takes it from the parent; where it has not (the
    embedded server's build), the migration passes and they keep the default, pglz."""
    conn = await asyncpg.connect(pg_dsn)
    try:
        try:
            await conn.execute("CREATE TEMP TABLE lz4_probe (d jsonb COMPRESSION lz4)")
            expected = b"l"
        except asyncpg.FeatureNotSupportedError:
            expected = b"\x00"  # not set: the server's default_toast_compression
        before = await conn.fetch(COMPRESSED)
        assert before and {bytes(r["attcompression"]) for r in before} == {expected}
        await partitions.ensure(conn, ahead=8)
        after = await conn.fetch(COMPRESSED)
        assert len(after) > len(before) and {bytes(r["attcompression"]) for r in after} == {expected}
    finally:
        await conn.close()


async def test_postgres_draws_the_month_bounds_python_does(pg_dsn: str) -> None:
    # Instants at month edges (a microsecond either side), and random ones in zones either side
    # of UTC, named and bounded by Postgres (budgetgate_partition_name, budgetgate_attach_month)
    # as budgetgate.ledger.partitions names and bounds them.
    shuffle = random.Random(20260033)
    edges = [datetime(y, m, 1, tzinfo=UTC) + timedelta(microseconds=d) for y in (1999, 2024, 2025, 2028) for m in (1, 2, 3, 12) for d in (-1, 0, 1)]
    zones = [timezone(timedelta(minutes=shuffle.randint(-14 * 60, 14 * 60))) for _ in range(40)]
    spread = [datetime(2000, 1, 1, tzinfo=UTC) + timedelta(seconds=shuffle.randint(0, 40 * 365 * 86400)) for _ in range(40)]
    instants = edges + [at.astimezone(zone) for at, zone in zip(spread, zones, strict=True)]
    conn = await asyncpg.connect(pg_dsn, server_settings={"TimeZone": "America/Sao_Paulo"})  # the session's zone plays no part
    try:
        names = await conn.fetch("SELECT at, budgetgate_partition_name('decisions', at) AS name FROM unnest($1::timestamptz[]) AS at", instants)
        assert [r["name"] for r in names] == [partitions.partition_name("decisions", at) for at in instants]
        months = sorted({partitions.month_start(at) for at in edges})
        async with conn.transaction():
            for month in months:
                await conn.execute("SELECT budgetgate_ensure_month('decisions', $1)", month + timedelta(days=3))
        found = {p.name: (p.start, p.end) for p in await partitions.partitions(conn, ["decisions"])}
        for month in months:
            assert found[partitions.partition_name("decisions", month)] == (month, partitions.add_months(month, 1))
    finally:
        await conn.close()
