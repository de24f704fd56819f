"""A database built from the numbered migrations equals one built from sql/schema.sql."""

from __future__ import annotations

from importlib import resources

import asyncpg

from budgetgate.ledger.migrations import migrate, migration_files
from tests.support.databases import drop_database, empty_database

CATALOG = """
SELECT 'column' AS kind, table_name || '.' || column_name || ' ' || data_type || ' ' || is_nullable || ' ' || coalesce(column_default, '') AS what
FROM information_schema.columns WHERE table_schema = 'public' AND table_name <> 'schema_migrations'
UNION ALL
SELECT 'index', indexdef FROM pg_indexes WHERE schemaname = 'public' AND tablename <> 'schema_migrations'
UNION ALL
SELECT 'constraint', conrelid::regclass || ' ' || pg_get_constraintdef(oid) FROM pg_constraint
WHERE connamespace = 'public'::regnamespace AND conrelid::regclass::text <> 'schema_migrations'
UNION ALL
SELECT 'function', pg_get_functiondef(p.oid) FROM pg_proc p WHERE p.pronamespace = 'public'::regnamespace
UNION ALL
SELECT 'view', viewname || ': ' || definition FROM pg_views WHERE schemaname = 'public'
UNION ALL
SELECT 'compression', a.attrelid::regclass || '.' || a.attname || ' ' || a.attcompression::text FROM pg_attribute a
JOIN pg_class c ON c.oid = a.attrelid WHERE c.relnamespace = 'public'::regnamespace AND a.attcompression <> ''
UNION ALL
SELECT 'trigger', pg_get_triggerdef(t.oid) FROM pg_trigger t
JOIN pg_class c ON c.oid = t.tgrelid WHERE c.relnamespace = 'public'::regnamespace AND NOT t.tgisinternal
UNION ALL
SELECT 'storage options', c.relname || ' ' || array_to_string(c.reloptions, ',') FROM pg_class c
WHERE c.relnamespace = 'public'::regnamespace AND c.reloptions IS NOT NULL
ORDER BY 1, 2
"""


async def _catalog(dsn: str) -> list[tuple[str, str]]:
    conn = await asyncpg.connect(dsn)
    try:
        return [(r["kind"], r["what"]) for r in await conn.fetch(CATALOG)]
    finally:
        await conn.close()


async def test_migrations_and_schema_file_build_the_same_database(pg_dsn) -> None:
    schema = resources.files("budgetgate.ledger").joinpath("sql", "schema.sql").read_text()
    names = []
    try:
        a_name, a_dsn = await empty_database(pg_dsn, prefix="drift")
        b_name, b_dsn = await empty_database(pg_dsn, prefix="drift")
        names = [a_name, b_name]
        conn = await asyncpg.connect(a_dsn)
        try:
            applied = await migrate(conn)
            assert applied == [name for name, _ in migration_files()]
            assert await migrate(conn) == []  # idempotent
        finally:
            await conn.close()
        conn = await asyncpg.connect(b_dsn)
        try:
            await conn.execute(schema)
        finally:
            await conn.close()
        from_migrations, from_schema = await _catalog(a_dsn), await _catalog(b_dsn)
        assert from_migrations, "the catalog query found nothing"
        missing = sorted(set(from_migrations) - set(from_schema))
        extra = sorted(set(from_schema) - set(from_migrations))
        assert not missing and not extra, f"schema.sql drifted from the migrations: missing {missing}, extra {extra}"
    finally:
        for name in names:
            await drop_database(pg_dsn, name)


async def test_the_catalog_compares_view_definitions(pg_dsn) -> None:
    # A view redefined by a migration but not in schema.sql (or the other way) is drift too.
    before = await _catalog(pg_dsn)
    assert any(kind == "view" and what.startswith("audit_window_exhaustion: ") for kind, what in before)
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(
            "CREATE OR REPLACE VIEW audit_evidence_backlog AS SELECT 0::bigint AS pending, 0::bigint AS dead, 0::bigint AS "
            "delivered, 0::numeric AS oldest_pending_seconds"
        )
    finally:
        await conn.close()
    changed = sorted(set(before) ^ set(await _catalog(pg_dsn)))
    assert [kind for kind, _ in changed] == ["view", "view"]


async def test_migration_0021_keeps_decisions_that_already_share_a_ledger_number(pg_dsn) -> None:
    # A database written before 0021 may hold decisions with one ledger sequence number (a Redis
    # that lost writes was decided on): they stay, numbers above the highest of them are unique,
    # and the migration says so.
    name, dsn = await empty_database(pg_dsn, prefix="m0021")
    conn = await asyncpg.connect(dsn)
    try:
        earlier = [(n, text) for n, text in migration_files() if n < "0021"]
        async with conn.transaction():
            for _, text in earlier:
                await conn.execute(text)
        for run_id, seq in (("a", 3), ("b", 5), ("c", 5)):
            await conn.execute(
                "INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, projected_gpu, request, response, decided_at, "
                "ledger_seq) VALUES (gen_random_uuid(), $1, 1, 'ALLOW', 'fits', 'ns', '{}', 8, '{}', '{}', now(), $2)",
                run_id,
                seq,
            )
        warnings: list[str] = []
        conn.add_log_listener(lambda _conn, message: warnings.append(str(message)))
        [(_, text)] = [(n, t) for n, t in migration_files() if n.startswith("0021")]
        await conn.execute(text)
        assert any("1 ledger sequence number(s) are recorded by more than one decision, the highest 5" in w for w in warnings), warnings
        indexes = dict(await conn.fetch("SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'decisions' AND indexname LIKE 'decisions_ledger_seq%'"))
        assert indexes["decisions_ledger_seq"].startswith("CREATE UNIQUE INDEX") and indexes["decisions_ledger_seq"].endswith("WHERE (ledger_seq > 5)")
        assert "decisions_ledger_seq_reused" in indexes
        assert await conn.fetchval("SELECT count(*) FROM decisions WHERE ledger_seq = 5") == 2  # history kept
        insert = (
            "INSERT INTO decisions (decision_id, run_id, attempt, outcome, reason, namespace, labels, projected_gpu, request, response, decided_at, "
            "ledger_seq) VALUES (gen_random_uuid(), $1, 1, 'ALLOW', 'fits', 'ns', '{}', 8, '{}', '{}', now(), 6)"
        )
        await conn.execute(insert, "d")
        try:
            await conn.execute(insert, "e")
        except asyncpg.UniqueViolationError as exc:
            assert exc.constraint_name == "decisions_ledger_seq"
        else:
            raise AssertionError("a number above the reused ones was recorded twice")
    finally:
        await conn.close()
        await drop_database(pg_dsn, name)
