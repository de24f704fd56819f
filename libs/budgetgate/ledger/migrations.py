"""Numbered, append-only SQL migrations (sql/migrations/NNNN_name.sql), applied in order."""

from __future__ import annotations

import re
from importlib import resources

import asyncpg

_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
# One migrator at a time, whatever the number of processes starting together.
_LOCK = "SELECT pg_advisory_xact_lock(7300, 0)"


def migration_files() -> list[tuple[str, str]]:
    """(name, sql) of every migration shipped with the package, in order."""
    folder = resources.files("budgetgate.ledger").joinpath("sql", "migrations")
    names = sorted(entry.name for entry in folder.iterdir() if _NAME.match(entry.name))
    numbers = [int(n[:4]) for n in names]
    # Unique and increasing; a gap is allowed, because numbers are handed out to branches
    # developed in parallel and one may merge before another (each applies once, by name).
    if len(set(numbers)) != len(numbers) or (numbers and numbers[0] < 1):
        raise RuntimeError(f"migration numbers must be unique and start at 1 or later, found {numbers}")
    return [(name.removesuffix(".sql"), folder.joinpath(name).read_text()) for name in names]


async def migrate(conn: asyncpg.Connection) -> list[str]:
    """Apply every migration not yet applied; returns the names applied now."""
    applied_now = []
    async with conn.transaction():
        await conn.execute(_LOCK)
        await conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations (name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())")
        done = {row["name"] for row in await conn.fetch("SELECT name FROM schema_migrations")}
        for name, sql in migration_files():
            if name in done:
                continue
            if _has_statements(sql):  # asyncpg rejects a query that is only comments
                await conn.execute(sql)
            await conn.execute("INSERT INTO schema_migrations (name) VALUES ($1)", name)
            applied_now.append(name)
    return applied_now


async def migrate_dsn(dsn: str) -> list[str]:
    """Connect to `dsn`, migrate, disconnect."""
    conn = await asyncpg.connect(dsn)
    try:
        return await migrate(conn)
    finally:
        await conn.close()


def _has_statements(sql: str) -> bool:
    code = "\n".join(line.split("--", 1)[0] for line in sql.splitlines())
    return bool(code.replace(";", "").strip())
