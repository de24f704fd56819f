"""Numbered, append-only SQL migrations (sql/migrations/NNNN_name.sql), applied in order.

Each migration runs in a transaction of its own, recorded in `schema_migrations` in that same
transaction, so a failure leaves nothing of it behind and keeps those before it; every lock it
waits for gives up after `lock_timeout_seconds` (a migration queued behind a long transaction
would otherwise queue every admission behind itself). A migration whose first line is
`-- budgetgate: no-transaction` runs statement by statement outside any transaction, as
`CREATE INDEX CONCURRENTLY` must; it is recorded once all its statements succeeded, so it must
be written to be run again from the start (`DROP INDEX CONCURRENTLY IF EXISTS` first: a failed
concurrent build leaves an invalid index behind).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from importlib import resources

import asyncpg

_NAME = re.compile(r"^(\d{4})_[a-z0-9_]+\.sql$")
NO_TRANSACTION = "-- budgetgate: no-transaction"
# One migrator at a time, whatever the number of processes starting together: a session lock
# (the same key as the transaction-scoped one of earlier releases, which it conflicts with),
# held across the migrations' own transactions and waited for without a timeout.
_LOCK_KEY = (7300, 0)
DEFAULT_LOCK_TIMEOUT_SECONDS = 5.0

# Other sessions holding a lock on a table the migration names: who the migration waited for.
_HOLDERS = """
SELECT a.pid, coalesce(nullif(a.application_name, ''), a.usename::text, '?') AS who, coalesce(a.state, '?') AS state,
       extract(epoch FROM now() - coalesce(a.xact_start, a.query_start, now()))::bigint AS seconds,
       left(coalesce(a.query, ''), 120) AS query, array_agg(DISTINCT c.relname::text ORDER BY c.relname::text) AS tables
FROM pg_locks l
JOIN pg_class c ON c.oid = l.relation
JOIN pg_stat_activity a ON a.pid = l.pid
WHERE l.granted AND l.locktype = 'relation' AND l.pid <> pg_backend_pid()
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND c.relname = ANY($1::text[])
GROUP BY a.pid, a.application_name, a.usename, a.state, a.xact_start, a.query_start, a.query
ORDER BY min(a.xact_start) NULLS LAST
LIMIT 5
"""


class MigrationLockTimeout(RuntimeError):
    """A migration waited longer than the lock timeout for a lock and was given up; the message
    names the sessions holding locks on its tables and what to do."""


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


def in_transaction(sql: str) -> bool:
    """False for a migration marked to run outside a transaction (its first line)."""
    first = sql.lstrip("\ufeff").split("\n", 1)[0].strip()
    return first != NO_TRANSACTION


async def migrate(
    conn: asyncpg.Connection,
    *,
    lock_timeout_seconds: float = DEFAULT_LOCK_TIMEOUT_SECONDS,
    migrations: Sequence[tuple[str, str]] | None = None,
) -> list[str]:
    """Apply every migration not yet applied (by default those shipped with the package); returns
    the names applied now. Raises MigrationLockTimeout when one waits too long for a lock."""
    if conn.is_in_transaction():
        raise RuntimeError("migrate() runs its own transactions: call it outside one")
    applied_now: list[str] = []
    await conn.execute("SELECT pg_advisory_lock($1, $2)", *_LOCK_KEY)
    try:
        previous = await conn.fetchval("SELECT current_setting('lock_timeout')")
        await conn.execute("SELECT set_config('lock_timeout', $1, false)", f"{max(1, round(lock_timeout_seconds * 1000))}ms")
        try:
            await conn.execute("CREATE TABLE IF NOT EXISTS schema_migrations (name text PRIMARY KEY, applied_at timestamptz NOT NULL DEFAULT now())")
            done = {row["name"] for row in await conn.fetch("SELECT name FROM schema_migrations")}
            for name, sql in migration_files() if migrations is None else migrations:
                if name in done:
                    continue
                try:
                    await _apply(conn, name, sql)
                except asyncpg.LockNotAvailableError as exc:
                    raise MigrationLockTimeout(await _explain(conn, name, sql, applied_now, lock_timeout_seconds)) from exc
                applied_now.append(name)
        finally:
            await conn.execute("SELECT set_config('lock_timeout', $1, false)", previous)
    finally:
        await conn.execute("SELECT pg_advisory_unlock($1, $2)", *_LOCK_KEY)
    return applied_now


async def migrate_dsn(dsn: str, *, lock_timeout_seconds: float = DEFAULT_LOCK_TIMEOUT_SECONDS) -> list[str]:
    """Connect to `dsn`, migrate, disconnect."""
    conn = await asyncpg.connect(dsn)
    try:
        return await migrate(conn, lock_timeout_seconds=lock_timeout_seconds)
    finally:
        await conn.close()


async def pending(conn: asyncpg.Connection) -> list[str]:
    """The shipped migrations the database has not applied yet (all of them on an empty one)."""
    if not await conn.fetchval("SELECT to_regclass('schema_migrations') IS NOT NULL"):
        return [name for name, _ in migration_files()]
    done = {row["name"] for row in await conn.fetch("SELECT name FROM schema_migrations")}
    return [name for name, _ in migration_files() if name not in done]


def main() -> None:
    """`python -m budgetgate.ledger.migrations`: exit 1, naming them, while migrations this code
    ships are not applied (the Kubernetes Deployments' startup probe), else 0."""
    import asyncio
    import sys

    from budgetgate.runtime.settings import CommonSettings

    async def check(dsn: str) -> list[str]:
        conn = await asyncpg.connect(dsn, timeout=5)
        try:
            return await pending(conn)
        finally:
            await conn.close()

    missing = asyncio.run(check(CommonSettings().postgres_dsn))
    if missing:
        print(f"{len(missing)} migration(s) not applied yet: {', '.join(missing)}; run `budgetgate db migrate`", file=sys.stderr)
        sys.exit(1)


async def _apply(conn: asyncpg.Connection, name: str, sql: str) -> None:
    record = "INSERT INTO schema_migrations (name) VALUES ($1)"
    if in_transaction(sql):
        async with conn.transaction():
            if _has_statements(sql):  # asyncpg rejects a query that is only comments
                await conn.execute(sql)
            await conn.execute(record, name)
        return
    # One statement per query: several in one query string run in one implicit transaction,
    # which CREATE INDEX CONCURRENTLY refuses.
    for statement in statements(sql):
        await conn.execute(statement)
    await conn.execute(record, name)


async def _explain(conn: asyncpg.Connection, name: str, sql: str, applied_now: list[str], timeout: float) -> str:
    words = sorted(set(re.findall(r"[a-z_][a-z0-9_]*", _code(sql).lower())))
    try:
        holders = await conn.fetch(_HOLDERS, words)
    except asyncpg.PostgresError:
        holders = []
    lines = [
        f"migration {name} waited more than {timeout:g}s for a lock and was given up"
        + (" (its statements before the one that waited stay applied; it is not recorded and runs again from the start)" if not in_transaction(sql) else "")
        + (f"; applied before it now: {', '.join(applied_now)}" if applied_now else "; nothing was applied now"),
    ]
    if holders:
        lines.append("sessions holding locks on its tables (the oldest transaction first):")
        lines += [f"  pid {h['pid']} ({h['who']}, {h['state']} for {h['seconds']}s) on {', '.join(h['tables'])}: {h['query']!r}" for h in holders]
    else:
        lines.append("no session holds a lock on its tables any more")
    lines.append(
        "Retry `budgetgate db migrate` once they are done (end a stuck session with SELECT pg_terminate_backend(pid)), or in a quiet window "
        '(docs/operations.md, "Upgrades"); BUDGETGATE_MIGRATION_LOCK_TIMEOUT_SECONDS sets how long a migration waits.'
    )
    return "\n".join(lines)


def statements(sql: str) -> list[str]:
    """The statements of a SQL script, split at semicolons outside quotes, dollar quotes and comments."""
    found: list[str] = []
    start = i = 0
    n = len(sql)
    while i < n:
        c = sql[i]
        if sql.startswith("--", i):
            i = _after(sql, "\n", i + 2)
        elif sql.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if sql.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif sql.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    i += 1
        elif c in "'\"":
            escapes = c == "'" and i > 0 and sql[i - 1] in "eE" and (i == 1 or not (sql[i - 2].isalnum() or sql[i - 2] == "_"))
            i += 1
            while i < n and sql[i] != c:
                i += 2 if escapes and sql[i] == "\\" else 1
            i += 1  # a doubled quote closes and reopens: same result
        elif c == "$" and (tag := re.match(r"\$([A-Za-z_][A-Za-z0-9_]*)?\$", sql[i:])) and not (i and (sql[i - 1].isalnum() or sql[i - 1] == "_")):
            i = _after(sql, tag.group(0), i + len(tag.group(0)))
        elif c == ";":
            found.append(sql[start : i + 1])
            start = i = i + 1
        else:
            i += 1
    found.append(sql[start:])
    return [s.strip() for s in found if _has_statements(s)]


def _after(sql: str, token: str, start: int) -> int:
    end = sql.find(token, start)
    return len(sql) if end < 0 else end + len(token)


def _code(sql: str) -> str:
    return "\n".join(line.split("--", 1)[0] for line in sql.splitlines())


def _has_statements(sql: str) -> bool:
    return bool(_code(sql).replace(";", "").strip())


if __name__ == "__main__":
    main()
