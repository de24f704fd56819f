"""`budgetgate ledger …`: Redis's copy of the ledger. Postgres is the truth; Redis is rebuilt
from it (libs/budgetgate/ledger/sync.py does the work, under the exclusive ledger lock)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import click

from budgetgate.settings import CommonSettings

if TYPE_CHECKING:
    from budgetgate.ledger.sync import Drift, LedgerSync


@click.group()
def ledger() -> None:
    """The ledger's Redis copy: rebuild it from Postgres, or compare the two."""


@ledger.command("rebuild-redis")
def rebuild_redis() -> None:
    """Replace Redis's copy of the ledger with Postgres's.

    After a restore of Postgres, a Redis loss or a drift the reconciler reports. Safe while the
    services run: reservations wait for the rebuild, which takes the ledger lock exclusively.
    """
    keys, runs = asyncio.run(_rebuild(CommonSettings()))
    click.echo(f"rebuilt Redis from Postgres: {keys} ledger key(s), {runs} run(s) holding reservations")


@ledger.command("check")
def check() -> None:
    """Compare Redis with Postgres; exit 1 when they differ (nothing is changed)."""
    drift = asyncio.run(_drift(CommonSettings()))
    if drift is None:
        click.echo("Redis does not hold the ledger (it is rebuilt before the next decision, or by `budgetgate ledger rebuild-redis`)")
        sys.exit(1)
    if drift.clean:
        click.echo("Redis matches Postgres")
        return
    for key, (in_redis, in_postgres) in drift.keys.items():
        click.echo(f"ledger key {key}: Redis (reserved, consumed) {in_redis}, Postgres {in_postgres}")
    for run_id, (in_redis, in_postgres) in drift.runs.items():
        click.echo(f"run {run_id}: Redis holds {in_redis}, Postgres {in_postgres}")
    sys.exit(1)


async def _rebuild(settings: CommonSettings) -> tuple[int, int]:
    async with _sync(settings) as sync:
        await sync.rebuild(force=True)
        return len(await sync.redis.all_readings()), len(await sync.redis.run_holds())


async def _drift(settings: CommonSettings) -> Drift | None:
    async with _sync(settings) as sync:
        return await sync.check_drift(repair=False)


@contextlib.asynccontextmanager
async def _sync(settings: CommonSettings) -> AsyncIterator[LedgerSync]:
    """A LedgerSync on the configured Postgres and Redis, closed on exit."""
    import asyncpg
    import redis.asyncio as aioredis

    from budgetgate.ledger.redis_ledger import RedisLedger
    from budgetgate.ledger.sync import LedgerSync

    pool = await asyncpg.create_pool(settings.postgres_dsn, min_size=1, max_size=2, command_timeout=60)
    client = aioredis.from_url(settings.redis_url, socket_connect_timeout=5)
    try:
        yield LedgerSync(pool, RedisLedger(client, prefix=settings.redis_prefix))
    finally:
        await client.aclose()
        await pool.close()
