"""Invariant 9 for a sample's lookups: finding the recorded sample of the same id (by its usage
record's event id, 0038) and its neighbours reads a handful of index pages, however long the
run's history, in the query the core uses (usage_neighbours)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta

import asyncpg
import pytest

from budgetgate.core.metering import usage_event_id
from budgetgate.ledger.queries import owned_by

HISTORY = 20_000  # recorded samples of one run, a minute apart: about 14 days
START = datetime(2026, 11, 1, tzinfo=UTC)


async def _seed(conn: asyncpg.Connection) -> None:
    # The history's month gets its partition, as the ledger's hourly upkeep makes one for every
    # month holding records; a month the migrations did not make (they make this month's and the
    # next ones) would otherwise leave the history in the default partition.
    await conn.execute("SELECT budgetgate_ensure_month('usage_records', $1)", START)
    rows = [("long", f"s{i}", START + timedelta(minutes=i), i, 0, i, 0, 1, 0, False, "test", "kafka", usage_event_id("long", f"s{i}")) for i in range(HISTORY)]
    await conn.copy_records_to_table(
        "usage_records",
        records=rows,
        columns=[
            "run_id", "sample_id", "observed_at", "gpu_milli_hours", "node_milli_hours", "gpu_milli_hours_cumulative", "node_milli_hours_cumulative",
            "gpu_milli_hours_delta", "node_milli_hours_delta", "late", "exporter", "source", "event_id",
        ],
    )  # fmt: skip
    await conn.execute(
        "INSERT INTO usage_runs (run_id, gpu_milli_hours_cumulative, samples, latest_observed_at, earliest_observed_at) VALUES ('long', $1, $2, $3, $4)",
        HISTORY - 1, HISTORY, START + timedelta(minutes=HISTORY - 1), START,
    )  # fmt: skip
    await conn.execute("ANALYZE usage_records")


async def _pages(conn: asyncpg.Connection, query: str, *args: object) -> tuple[int, list[str]]:
    """Shared buffers the query touched, and the roles of the rows it returned."""
    [plan] = json.loads(await conn.fetchval(f"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {query}", *args))
    rows = await conn.fetch(query, *args)
    top = plan["Plan"]
    return top["Shared Hit Blocks"] + top["Shared Read Blocks"], [r["role"] for r in rows]


async def test_a_samples_lookups_read_a_handful_of_pages_however_long_its_runs_history(pg_dsn: str) -> None:
    conn = await asyncpg.connect(pg_dsn)
    try:
        await _seed(conn)
        heap_pages = await conn.fetchval("SELECT sum(relpages) FROM pg_class WHERE relname LIKE 'usage_records_p%' AND relkind = 'r'")
        assert heap_pages > 150, "the history should span many pages"
        neighbours = owned_by("budgetgate.services.metering_ingest")("usage_neighbours")
        cases = {
            # A repeat of a recorded sample in the middle of the history (late): same id, same time, both sides.
            "s10000": (START + timedelta(minutes=10_000), ["same_id", "same_time", "before", "after"]),
            # A new sample after everything recorded.
            "new": (START + timedelta(minutes=HISTORY + 1), ["before"]),
        }
        for sample, (at, roles) in cases.items():
            pages, found = await _pages(conn, neighbours, "long", sample, at, usage_event_id("long", sample))
            assert found == roles
            assert pages < 60, f"{sample}: {pages} pages read for its lookups, of {heap_pages} the run's history fills"
    finally:
        await conn.close()


async def test_a_batchs_lookups_read_a_handful_of_pages_however_long_its_runs_history(pg_dsn: str) -> None:
    """The same for metering_begin_batch, whose statements run inside PL/pgSQL: their plans come
    from auto_explain (Postgres's contrib module), as log messages to this session."""
    conn = await asyncpg.connect(pg_dsn)
    plans: list[dict[str, object]] = []
    conn.add_log_listener(lambda _conn, message: plans.append(json.loads(message.message.partition("plan:\n")[2])) if "plan:" in message.message else None)
    try:
        await _seed(conn)
        try:
            await conn.execute("LOAD 'auto_explain'")
        except asyncpg.PostgresError as exc:
            pytest.skip(f"this Postgres has no auto_explain to show a function's plans: {exc}")
        samples = ["s10000", "new"]
        at = [START + timedelta(minutes=10_000), START + timedelta(minutes=HISTORY + 1)]
        args = (["long", "long"], samples, at, [usage_event_id("long", s) for s in samples])
        async with conn.transaction():
            await conn.execute(
                "SET LOCAL auto_explain.log_min_duration = 0; SET LOCAL auto_explain.log_nested_statements = on; SET LOCAL auto_explain.log_analyze = on;"
                " SET LOCAL auto_explain.log_buffers = on; SET LOCAL auto_explain.log_format = json; SET LOCAL client_min_messages = log"
            )
            rows = await conn.fetch("SELECT idx, role FROM metering_begin_batch($1, $2, $3, $4) ORDER BY idx NULLS FIRST, role", *args)
        await asyncio.sleep(0.1)  # the last log messages reach the listener
        assert [(r["idx"], r["role"]) for r in rows] == [(None, "run"), (1, "after"), (1, "before"), (1, "same_id"), (1, "same_time"), (2, "before")]
        nested = [p["Plan"] for p in plans if "metering_begin_batch" not in str(p.get("Query Text"))]
        assert nested, "auto_explain showed none of the function's statements"
        pages = sum(p["Shared Hit Blocks"] + p["Shared Read Blocks"] for p in nested)  # type: ignore[index,operator]
        assert pages < 120, f"{pages} pages read by the batch's lookups: {[(p['Node Type'], p['Shared Hit Blocks']) for p in nested]}"  # type: ignore[index]
    finally:
        await conn.close()
