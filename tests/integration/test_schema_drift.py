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
SELECT 'trigger', pg_get_triggerdef(t.oid) FROM pg_trigger t
JOIN pg_class c ON c.oid = t.tgrelid WHERE c.relnamespace = 'public'::regnamespace AND NOT t.tgisinternal
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
