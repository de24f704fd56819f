"""Monthly partitions of the ledger's growing tables (migrations 0033-0035): a month's partition is
`<table>_pYYYYMM` and holds [the first of the month, the first of the next) in UTC. Decisions,
their evaluations and usage records, whose times come from clocks outside Postgres, have a
`<table>_default` partition that takes a row of a month without one (the next `ensure` moves it
into its month's partition); the outbox, whose created_at is Postgres's own clock, has none (a
row of a month not created is refused) and so is detached CONCURRENTLY when archived. Months are
created ahead: by the migrations, by admission, metering-ingest and the reconciler (the writers
of these tables) when they start and then once an hour (`keep_ahead`), and by `budgetgate ledger
partitions` and `archive`. A month archived
(budgetgate.ledger.archive) is never created again.

The month arithmetic is here, pure (tests/property/test_partition_props.py); the SQL functions
budgetgate_ensure_partitions and budgetgate_attach_month do the same in Postgres, and a test
holds the two to the same bounds."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import asyncpg

from budgetgate.ledger.queries import sql

log = logging.getLogger(__name__)

# The tables partitioned by month, with the column they are partitioned by. Tables of one series
# are archived together, month by month (budgetgate.ledger.archive.SERIES).
PARTITIONED: dict[str, str] = {
    "decisions": "decided_at",
    "decision_evaluations": "decided_at",
    "usage_records": "observed_at",
    "outbox": "created_at",
}
DEFAULT_AHEAD = 3
# How long creating a partition waits for its brief lock on a busy table before giving up (a
# service starting, the reconciler's tick); the next try creates it.
LOCK_TIMEOUT_SECONDS = 2.0


def month_start(at: datetime) -> datetime:
    """The first instant of `at`'s month in UTC (an aware datetime)."""
    if at.tzinfo is None:
        raise ValueError(f"{at!r} has no time zone: the ledger's months are UTC months of aware instants")
    utc = at.astimezone(UTC)
    return datetime(utc.year, utc.month, 1, tzinfo=UTC)


def add_months(month: datetime, months: int) -> datetime:
    """The first instant of the UTC month `months` after (before, when negative) that of `month`."""
    first = month_start(month)
    index = first.year * 12 + first.month - 1 + months
    year, zero_based = divmod(index, 12)
    return datetime(year, zero_based + 1, 1, tzinfo=UTC)


def partition_name(parent: str, at: datetime) -> str:
    """The partition of `parent` that holds instant `at`."""
    first = month_start(at)
    return f"{parent}_p{first.year:04d}{first.month:02d}"


def month_label(at: datetime) -> str:
    """`YYYY-MM` of `at`'s UTC month."""
    first = month_start(at)
    return f"{first.year:04d}-{first.month:02d}"


def retention_cutoff(now: datetime, retention_months: int) -> datetime:
    """The instant before which a month is older than the retention: the first of the UTC month
    `retention_months` before `now`'s. A partition is archived when it ends at or before it, so
    every row it held is at least `retention_months` calendar months old."""
    if retention_months < 1:
        raise ValueError(f"a retention of {retention_months} months keeps nothing: give 1 or more")
    return add_months(now, -retention_months)


@dataclass(frozen=True)
class Partition:
    """One partition as the catalog has it; `start` and `end` are None for the default one."""

    parent: str
    name: str
    start: datetime | None
    end: datetime | None
    rows: int  # an estimate (pg_class.reltuples), -1 before the table was first analyzed

    @property
    def default(self) -> bool:
        return self.start is None


async def partitions(conn: asyncpg.Connection, parents: Sequence[str] = tuple(PARTITIONED), *, exact_defaults: bool = False) -> list[Partition]:
    """The partitions of `parents`, by parent and then in month order (the default one last);
    with `exact_defaults`, the default partitions' rows counted (they are few, or worth a look)."""
    rows = await conn.fetch(sql("ledger_partitions"), list(parents))
    found = [Partition(r["parent"], r["name"], r["range_start"], r["range_end"], int(r["estimate"])) for r in rows]
    if exact_defaults:
        found = [replace(p, rows=await conn.fetchval(f'SELECT count(*) FROM "{p.name}"')) if p.default else p for p in found]
    return found


async def detached(conn: asyncpg.Connection, parents: Sequence[str] = tuple(PARTITIONED)) -> list[tuple[str, str, datetime]]:
    """(parent, name, month) of tables named as months of `parents` that are not attached: left by
    an archive that detached them and stopped before it dropped them."""
    return [(r["parent"], r["name"], r["month"]) for r in await conn.fetch(sql("ledger_detached"), list(parents))]


async def ensure(conn: asyncpg.Connection, *, ahead: int = DEFAULT_AHEAD, lock_timeout: float = LOCK_TIMEOUT_SECONDS) -> list[str]:
    """Create the partitions of this month and the `ahead` after it, of every partitioned table,
    and move rows the default partitions hold into their months' partitions; returns those
    created. One transaction; a lock not granted within `lock_timeout`, or rows of a month that
    arrived in its default partition while the month was being made (budgetgate_attach_month,
    0050), raise asyncpg.LockNotAvailableError with nothing changed."""
    if ahead < 1:
        raise ValueError(f"months ahead must be 1 or more, not {ahead}: the outbox has no default partition, next month's must exist before it starts")
    async with conn.transaction():
        await conn.execute("SELECT set_config('lock_timeout', $1, true)", f"{max(1, round(lock_timeout * 1000))}ms")
        created: list[str] = []
        for parent in PARTITIONED:
            created += [r[0] for r in await conn.fetch(sql("ensure_partitions"), parent, ahead)]
    return created


async def ensure_quietly(pool: asyncpg.Pool, *, ahead: int = DEFAULT_AHEAD) -> list[str]:
    """`ensure`, for a service: a busy table (the lock not granted in time), an unreachable
    Postgres or any other failure is logged and left for the next try, never fatal (months are
    created ahead, so an hour or two without costs nothing)."""
    try:
        async with pool.acquire() as conn:
            created = await ensure(conn, ahead=ahead)
    except (asyncpg.PostgresError, asyncpg.InterfaceError, OSError) as exc:
        log.warning("monthly partitions not created ahead this time (%s: %s); the next try does it", type(exc).__name__, exc)
        return []
    if created:
        log.info("created monthly partitions %s", ", ".join(created))
    return created


async def keep_ahead(pool: asyncpg.Pool, *, ahead: int = DEFAULT_AHEAD, every: float = 3600.0) -> None:
    """A service's background task: the months ahead created now, and again every `every`
    seconds (a process running for months never runs out of them)."""
    while True:
        await ensure_quietly(pool, ahead=ahead)
        await asyncio.sleep(every)
