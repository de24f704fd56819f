"""A connection that calls a batch function while its tables are empty, as every connection of
a new deployment does, must still use the tables' indexes once they have grown, before any
ANALYZE: PL/pgSQL keeps the generic plan it made on the empty tables, and with begin_batch's
first query (DISTINCT ON over run_id = ANY) that was a full scan per batch (admission's open
loop got slower with every decision it stored; this test found 4 full scans of decisions).
begin_batch now probes the index per run (0020), a plan that stays right whenever it is made;
the metering functions are planned for each call (0019); since 0039 begin_batch always takes
its generic plan, so that plan must probe the decisions' partitions too. Each test counts the
sequential scans of the grown table, every partition of it, in its own transaction
(pg_stat_xact_user_tables; a partitioned table has none of its own, which these tests counted
until 0039, so they could not fail)."""

from __future__ import annotations

from datetime import timedelta

import asyncpg
import pytest

from tests.support.metering import T0, decide

ROWS = 20_000


async def _scans(conn: asyncpg.Connection, table: str) -> int:
    """Sequential scans of `table` in this transaction, of all its partitions when it has them (a
    partitioned table has no scans of its own to count)."""
    return int(
        await conn.fetchval(
            "SELECT COALESCE(sum(s.seq_scan), 0) FROM pg_partition_tree($1::regclass) AS t JOIN pg_stat_xact_user_tables AS s ON s.relid = t.relid",
            table,
        )
    )


async def test_begin_batch_finds_runs_by_index_after_decisions_grew_without_analyze(pg_dsn: str) -> None:
    conn = await asyncpg.connect(pg_dsn)
    try:
        for _ in range(8):  # more than the five calls after which a generic plan is kept
            async with conn.transaction():
                await conn.fetch("SELECT * FROM budgetgate_begin_batch($1::text[])", ["run-a", "run-b"])
        await conn.execute(
            """INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, projected_gpu, request, response, decided_at)
               SELECT gen_random_uuid(), 'run-' || i, 1, 'ALLOW', 'test', 'test', '{}', 0, '{}', '{}', now() FROM generate_series(1, $1) AS i""",
            ROWS,
        )
        async with conn.transaction():
            found = await conn.fetch("SELECT run_id FROM budgetgate_begin_batch($1::text[]) WHERE run_id IS NOT NULL", ["run-7", "run-9"])
            assert sorted(r["run_id"] for r in found) == ["run-7", "run-9"]
            assert await _scans(conn, "decisions") == 0
    finally:
        await conn.close()


async def test_place_batch_finds_samples_by_index_after_usage_grew_without_analyze(pg_dsn: str) -> None:
    # With a capacity, so that every sample is compared with its run's bound (5 %, 300 s slack).
    await decide(pg_dsn, "long-run", gpus=8, nodes=1, decided_at=T0 - timedelta(minutes=1))
    conn = await asyncpg.connect(pg_dsn)

    async def place(minute: int, sample_id: str) -> list[asyncpg.Record]:
        return await conn.fetch(
            "SELECT * FROM metering_place_batch($1, $2, $3, $4, $5, $6, $7, $8, $9, $10)",
            ["long-run"], [sample_id], [T0 + timedelta(minutes=minute)], [1000 * minute], [10 * minute], [""], ["kafka"], [f"e-{sample_id}"],
            50_000, 300_000_000,
        )  # fmt: skip

    try:
        for minute in range(8):
            async with conn.transaction():
                await place(minute, f"s{minute}")
        await conn.execute(
            """INSERT INTO usage_records (run_id, sample_id, observed_at, gpu_milli_hours, node_milli_hours, gpu_milli_hours_cumulative,
                                          node_milli_hours_cumulative, gpu_milli_hours_delta, node_milli_hours_delta, late, exporter, source, event_id)
               SELECT 'other-' || (i % 50), 's' || i, $2::timestamptz + i * interval '1 second', i, i, i, i, 1, 1, false, '', 'kafka', 'e-other-' || i
               FROM generate_series(1, $1) AS i""",
            ROWS, T0,
        )  # fmt: skip
        async with conn.transaction():
            [placed] = await place(9, "s9")
            assert placed["outcome"] == "accepted"
            assert await _scans(conn, "usage_records") == 0
    finally:
        await conn.close()


@pytest.mark.parametrize("published", [3_000, ROWS])
async def test_the_relay_claims_and_marks_by_index_after_the_outbox_grew_without_analyze(pg_dsn: str, published: int) -> None:
    """The relay's claim and mark are prepared statements, first run on an all but empty outbox;
    the outbox then keeps a replay window of published rows (15 minutes of every decision and
    usage record). The mark's generic plan, made on the small table, scanned all of them on
    every pass: admission's open loop got slower for as long as the window filled (2,409 full
    scans of the outbox, 10 million rows read, in 45 s at 700 decisions/s). Planned for its
    parameters, it still hashed the ids and scanned a table of a few thousand rows (20 s of the
    200/s open loop: 1.6 ms a pass); it now names its rows to the scan."""
    from budgetgate.messaging import outbox
    from budgetgate.ledger.queries import owned_by

    sql = owned_by("budgetgate.messaging")

    conn = await asyncpg.connect(pg_dsn)

    async def mark(*args: object) -> None:
        await conn.execute(sql("mark_published"), *args)

    try:
        await conn.execute("INSERT INTO outbox (topic, key, payload, headers) VALUES ('budget.decisions.v1', 'k', '\\x02', '[]')")
        for _ in range(8):  # more than the five runs after which a generic plan is kept
            async with conn.transaction():
                [first] = await outbox.claim(conn, 1000)
                await mark([first["id"]], [0], ["t"], [0], [0])
                await conn.execute("UPDATE outbox SET published_at = NULL")
        await conn.execute("DELETE FROM outbox")
        await conn.execute(  # a decision's message is about a kilobyte
            """INSERT INTO outbox (topic, key, payload, headers, published_at, kafka_partitions)
               SELECT 'budget.decisions.v1', 'k', decode(repeat('00', 1000), 'hex'), '[]', now(), '{0}' FROM generate_series(1, $1)""",
            published,
        )
        # A pass of a relay at 200 decisions/s: ten of them, one row each.
        await conn.execute("INSERT INTO outbox (topic, key, payload, headers) SELECT 'budget.decisions.v1', 'k', '\\x01', '[]' FROM generate_series(1, 10)")
        async with conn.transaction():
            # Counted from here: the setup's own scans may not be flushed from the counts yet.
            before = await _scans(conn, "outbox")
            rows = await outbox.claim(conn, 1000)
            assert [bytes(row["payload"]) for row in rows] == [b"\x01"] * 10
            assert await _scans(conn, "outbox") == before, "the claim scanned the outbox"
            await mark([row["id"] for row in rows], [0] * 10, ["t"], [0], [1])
            assert await _scans(conn, "outbox") == before, "the mark scanned the outbox"
    finally:
        await conn.close()
