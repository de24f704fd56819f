"""The migration runner: one transaction per migration, a lock timeout that names who blocked,
and migrations that must run outside a transaction (CREATE INDEX CONCURRENTLY)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from budgetgate.ledger.migrations import NO_TRANSACTION, MigrationLockTimeout, in_transaction, migrate, migration_files, statements
from tests.support.databases import drop_database, empty_database


@pytest.fixture
async def empty_dsn(postgres_admin_dsn: str) -> AsyncIterator[str]:
    name, dsn = await empty_database(postgres_admin_dsn, prefix="migr")
    yield dsn
    await drop_database(postgres_admin_dsn, name)


async def _applied(conn: asyncpg.Connection) -> list[str]:
    return [r["name"] for r in await conn.fetch("SELECT name FROM schema_migrations ORDER BY name")]


async def test_a_migration_kept_waiting_for_a_lock_gives_up_fast_names_the_blocker_and_keeps_the_ones_before(empty_dsn: str) -> None:
    # 0021 rebuilds an index of `decisions` (ACCESS EXCLUSIVE); a transaction that wrote a decision
    # and is still open (as admission's are, briefly) holds it up. Without a lock timeout the
    # migration queues behind it, and every admission behind the migration.
    shipped = migration_files()
    conn, blocker = await asyncpg.connect(empty_dsn), await asyncpg.connect(empty_dsn, server_settings={"application_name": "admission-test"})
    try:
        await migrate(conn, migrations=[m for m in shipped if m[0] < "0020"])
        blocker_tx = blocker.transaction()
        await blocker_tx.start()
        await blocker.execute("LOCK TABLE decisions IN ROW EXCLUSIVE MODE")
        started = time.monotonic()
        with pytest.raises(MigrationLockTimeout) as raised:
            await asyncio.wait_for(migrate(conn, lock_timeout_seconds=0.3), timeout=30)
        assert time.monotonic() - started < 10
        message = str(raised.value)
        assert "migration 0021_unique_ledger_seq waited more than 0.3s for a lock" in message, message
        assert f"pid {blocker.get_server_pid()} (admission-test, idle in transaction" in message and "on decisions" in message, message
        assert "applied before it now: 0020_begin_batch_by_run" in message and "Retry `budgetgate db migrate`" in message, message
        # 0020 committed in its own transaction; nothing of 0021 (or after it) is applied.
        assert await _applied(conn) == sorted(m for m, _ in shipped if m < "0021")
        index = await conn.fetchval("SELECT indexdef FROM pg_indexes WHERE indexname = 'decisions_ledger_seq'")
        assert index.startswith("CREATE INDEX"), index
        assert await conn.fetchval("SELECT current_setting('lock_timeout')") == "0", "the session's own lock timeout is restored"
        await blocker_tx.commit()
        assert await migrate(conn) == [m for m, _ in shipped if m >= "0021"]
        assert (await conn.fetchval("SELECT indexdef FROM pg_indexes WHERE indexname = 'decisions_ledger_seq'")).startswith("CREATE UNIQUE INDEX")
    finally:
        await blocker.close()
        await conn.close()


async def test_a_failing_migration_leaves_nothing_of_itself_and_keeps_the_ones_before(empty_dsn: str) -> None:
    migrations = [("0001_a", "CREATE TABLE a (x int);"), ("0002_b", "CREATE TABLE b (x int); SELECT 1 / 0;"), ("0003_c", "CREATE TABLE c (x int);")]
    conn = await asyncpg.connect(empty_dsn)
    try:
        with pytest.raises(asyncpg.DivisionByZeroError):
            await migrate(conn, migrations=migrations)
        assert await _applied(conn) == ["0001_a"]
        assert await conn.fetchval("SELECT array_agg(relname::text ORDER BY relname) FROM pg_class WHERE relname IN ('a', 'b', 'c')") == ["a"]
    finally:
        await conn.close()


async def test_a_migration_marked_no_transaction_can_build_indexes_concurrently(empty_dsn: str) -> None:
    concurrently = (
        f"{NO_TRANSACTION}\n-- 0002_t_indexes: built without blocking writers to t; re-runnable.\n"
        "DROP INDEX CONCURRENTLY IF EXISTS t_x;\nCREATE INDEX CONCURRENTLY t_x ON t (x);\n"
        "DROP INDEX CONCURRENTLY IF EXISTS t_y;\nCREATE UNIQUE INDEX CONCURRENTLY t_y ON t (y) WHERE y > 0; -- a comment; with a semicolon\n"
    )
    assert not in_transaction(concurrently) and in_transaction("-- 0001_t: a table\nCREATE TABLE t (x int)")
    migrations = [("0001_t", "CREATE TABLE t (x int, y int); INSERT INTO t VALUES (1, 1), (2, 2);"), ("0002_t_indexes", concurrently)]
    conn = await asyncpg.connect(empty_dsn)
    try:
        assert await migrate(conn, migrations=migrations) == ["0001_t", "0002_t_indexes"]
        valid = await conn.fetch("SELECT c.relname, i.indisvalid FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid WHERE c.relname IN ('t_x', 't_y')")
        assert sorted(tuple(r) for r in valid) == [("t_x", True), ("t_y", True)]
        assert await _applied(conn) == ["0001_t", "0002_t_indexes"]
        assert await migrate(conn, migrations=migrations) == []
    finally:
        await conn.close()


def test_statements_split_only_at_semicolons_that_end_a_statement() -> None:
    script = (
        "-- a; comment\nSELECT 'a;b', \"c;d\";\n/* x; /* nested; */ y; */ SELECT E'it\\'s;';\n"
        "CREATE FUNCTION f() RETURNS int LANGUAGE sql AS $body$ SELECT 1; $body$;\nDO $$ BEGIN PERFORM 1; END $$;\nSELECT $1"
    )
    assert statements(script) == [
        "-- a; comment\nSELECT 'a;b', \"c;d\";",
        "/* x; /* nested; */ y; */ SELECT E'it\\'s;';",
        "CREATE FUNCTION f() RETURNS int LANGUAGE sql AS $body$ SELECT 1; $body$;",
        "DO $$ BEGIN PERFORM 1; END $$;",
        "SELECT $1",
    ]


async def test_every_shipped_migration_splits_into_statements_that_build_the_same_schema(empty_dsn: str, pg_dsn: str) -> None:
    # Should one of them ever be marked no-transaction, the split must not change what it does.
    conn = await asyncpg.connect(empty_dsn)
    try:
        for _, sql in migration_files():
            for statement in statements(sql):
                await conn.execute(statement)
        split = await conn.fetch("SELECT table_name, column_name, data_type FROM information_schema.columns WHERE table_schema = 'public'")
        functions = await conn.fetch("SELECT pg_get_functiondef(oid) AS f FROM pg_proc WHERE pronamespace = 'public'::regnamespace")
    finally:
        await conn.close()
    conn = await asyncpg.connect(pg_dsn)
    try:
        columns = await conn.fetch(
            "SELECT table_name, column_name, data_type FROM information_schema.columns WHERE table_schema = 'public' AND table_name <> 'schema_migrations'"
        )
        expected_functions = await conn.fetch("SELECT pg_get_functiondef(oid) AS f FROM pg_proc WHERE pronamespace = 'public'::regnamespace")
    finally:
        await conn.close()
    assert sorted(map(tuple, split)) == sorted(map(tuple, columns))
    assert sorted(r["f"] for r in functions) == sorted(r["f"] for r in expected_functions)


async def test_db_migrate_takes_its_lock_timeout_from_the_setting_and_says_who_blocked(empty_dsn: str, tmp_path: Path) -> None:
    conn, blocker = await asyncpg.connect(empty_dsn), await asyncpg.connect(empty_dsn, server_settings={"application_name": "long-report"})
    try:
        await migrate(conn, migrations=[m for m in migration_files() if m[0] < "0021"])
        async with blocker.transaction():
            await blocker.execute("LOCK TABLE decisions IN ACCESS SHARE MODE")
            env = {k: v for k, v in os.environ.items() if not k.startswith("BUDGETGATE_")}
            env.update(BUDGETGATE_POSTGRES_DSN=empty_dsn, BUDGETGATE_MIGRATION_LOCK_TIMEOUT_SECONDS="0.2")
            command = [sys.executable, "-m", "budgetgate.cli.main", "db", "migrate"]
            process = await asyncio.create_subprocess_exec(*command, cwd=tmp_path, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            _, err = await asyncio.wait_for(process.communicate(), timeout=60)
        assert process.returncode == 1
        assert "migration 0021_unique_ledger_seq waited more than 0.2s for a lock" in err.decode(), err.decode()
        assert "(long-report, idle in transaction" in err.decode() and "Traceback" not in err.decode()
        assert "0021_unique_ledger_seq" not in await _applied(conn)
    finally:
        await blocker.close()
        await conn.close()


async def test_the_startup_probe_fails_while_migrations_are_pending(empty_dsn: str, tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BUDGETGATE_")}
    env["BUDGETGATE_POSTGRES_DSN"] = empty_dsn
    command = [sys.executable, "-m", "budgetgate.ledger.migrations"]
    shipped = migration_files()

    async def probe() -> tuple[int | None, str]:
        process = await asyncio.create_subprocess_exec(*command, cwd=tmp_path, env=env, stderr=asyncio.subprocess.PIPE)
        _, err = await asyncio.wait_for(process.communicate(), timeout=60)
        return process.returncode, err.decode()

    code, err = await probe()
    assert code == 1 and f"{len(shipped)} migration(s) not applied yet: 0001_ledger" in err, err
    conn = await asyncpg.connect(empty_dsn)
    try:
        await migrate(conn, migrations=shipped[:-1])
        code, err = await probe()
        assert code == 1 and f"1 migration(s) not applied yet: {shipped[-1][0]};" in err, err
        await migrate(conn)
    finally:
        await conn.close()
    assert await probe() == (0, "")
