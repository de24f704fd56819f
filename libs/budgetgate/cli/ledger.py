"""`budgetgate ledger …`: Redis's copy of the ledger. Postgres is the truth; Redis is rebuilt
from it (libs/budgetgate/ledger/redis_sync.py does the work, under the exclusive ledger lock)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import click

from budgetgate.cli import backend
from budgetgate.runtime.settings import CommonSettings

if TYPE_CHECKING:
    from budgetgate.ledger.redis_sync import Drift, LedgerSync


@click.group()
def ledger() -> None:
    """The ledger's Redis copy: rebuild it from Postgres, or compare the two."""


def _settings() -> CommonSettings:
    # Both servers named (by the local stack or by variables): never the defaults' 127.0.0.1,
    # where a rebuild would rewrite whatever Redis happens to run there.
    return backend.stack_settings(needs=("postgres", "redis"))


@ledger.command("rebuild-redis")
def rebuild_redis() -> None:
    """Replace Redis's copy of the ledger with Postgres's.

    After a restore of Postgres, a Redis loss or a drift the reconciler reports. Safe while the
    services run: reservations wait for the rebuild, which takes the ledger lock exclusively.
    """
    keys, runs = asyncio.run(_rebuild(_settings()))
    click.echo(f"rebuilt Redis from Postgres: {keys} ledger key(s), {runs} run(s) holding reservations")


@ledger.command("check")
def check() -> None:
    """Compare Redis with Postgres; exit 1 when they differ (nothing is changed)."""
    drift = asyncio.run(_drift(_settings()))
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
    for name, (in_redis, in_postgres) in drift.counters.items():
        click.echo(f"quota counter {name}: Redis (gpus, nodes, allocations) {in_redis}, Postgres {in_postgres}")
    for namespace, (in_redis, in_postgres) in drift.pools.items():
        click.echo(f"pool {namespace}: Redis holds tokens {sorted(in_redis)}, Postgres {sorted(in_postgres)}" + _leases(in_redis, in_postgres))
    sys.exit(1)


def _leases(in_redis: dict[str, tuple[int, str]], in_postgres: dict[str, tuple[int, str]]) -> str:
    """Tokens both hold, but for another lease or owner."""
    differing = sorted(t for t in in_redis.keys() & in_postgres.keys() if in_redis[t] != in_postgres[t])
    return f" (lease or project differs for {', '.join(differing)})" if differing else ""


async def _rebuild(settings: CommonSettings) -> tuple[int, int]:
    async with _sync(settings) as sync:
        await sync.rebuild(force=True)
        return len(await sync.redis.all_readings()), len(await sync.redis.run_holds())


async def _drift(settings: CommonSettings) -> Drift | None:
    async with _sync(settings) as sync:
        return await sync.check_drift(repair=False)


@contextlib.asynccontextmanager
async def _sync(settings: CommonSettings) -> AsyncIterator[LedgerSync]:
    """A LedgerSync on the stack's Postgres and Redis (both checked reachable), closed on exit."""
    from budgetgate.ledger.redis_ledger import RedisLedger
    from budgetgate.ledger.redis_sync import LedgerSync

    async with backend.postgres_pool(settings.postgres_dsn) as pool, backend.redis(settings.redis_url) as client:
        yield LedgerSync(pool, RedisLedger(client, prefix=settings.redis_prefix))  # type: ignore[arg-type]
