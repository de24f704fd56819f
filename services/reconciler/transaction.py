"""The reconciler's unit of change to the ledger: one Postgres transaction holding the ledger
lock (shared) from before its Redis call until its commit, so a rebuild of Redis from Postgres
never misses a change Redis has seen. A change Redis made whose transaction then fails (or whose
commit cannot be confirmed) invalidates the Redis ledger, to be rebuilt from Postgres."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg

from budgetgate.ledger.queries import sql
from budgetgate.ledger.redis_ledger import RedisLedger

log = logging.getLogger(__name__)


@dataclass
class LedgerTransaction:
    conn: asyncpg.Connection
    ledger: RedisLedger
    redis_changed: bool = False


@contextlib.asynccontextmanager
async def ledger_transaction(pool: asyncpg.Pool, ledger: RedisLedger) -> AsyncIterator[LedgerTransaction]:
    """A transaction holding the ledger lock shared; commits on leaving the block."""
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        work = LedgerTransaction(conn, ledger)
        try:
            await conn.execute(sql("lock_ledger_shared"))
            yield work
        except BaseException:
            with contextlib.suppress(Exception):
                await tx.rollback()
            if work.redis_changed:
                await ledger.invalidate("a reconciler transaction failed after its Redis script")
            raise
        try:
            await tx.commit()
        except BaseException:
            if work.redis_changed:
                await ledger.invalidate("a reconciler commit failed or was not confirmed")
            raise
