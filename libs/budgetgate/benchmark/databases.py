"""Fresh Postgres databases for each measured run, on the server the settings name."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import asyncpg


def with_database(dsn: str, database: str) -> str:
    """`dsn` pointed at another database of the same server (URL-form DSNs)."""
    parts = urlsplit(dsn)
    if parts.scheme not in ("postgres", "postgresql"):
        raise ValueError(f"the benchmark needs a URL-form Postgres DSN (postgresql://…), not {dsn!r}")
    return urlunsplit(parts._replace(path="/" + database))


async def create(server_dsn: str, database: str) -> str:
    """Create `database` on the server of `server_dsn`; returns its DSN."""
    conn = await asyncpg.connect(server_dsn)
    try:
        await conn.execute(f'CREATE DATABASE "{database}"')
    finally:
        await conn.close()
    return with_database(server_dsn, database)


async def drop(server_dsn: str, database: str) -> None:
    """Drop `database`, disconnecting whoever is still on it."""
    conn = await asyncpg.connect(server_dsn)
    try:
        await conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
    finally:
        await conn.close()
