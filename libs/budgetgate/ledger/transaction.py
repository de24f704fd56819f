"""A unit of change to the ledger (a batch of admission decisions, a reconciler settlement): one
Postgres transaction holding the ledger lock (shared) from before its Redis call until its commit, so a rebuild of Redis from Postgres
never misses a change Redis has seen.

A settlement goes to Redis in two halves around the commit (settle_begin.lua / settle_end.lua):
the increases before, the decreases after, so Redis never shows more room than Postgres holds.
After a rollback its increases are taken back; when the commit cannot be confirmed, or this
process dies in between, the parked half waits for `Settler.end_pending`, which asks Postgres.
Any other Redis change whose transaction fails invalidates the Redis ledger, to be rebuilt."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import asyncpg

from budgetgate.ledger.queries import sql
from budgetgate.ledger.redis_ledger import LedgerNotLoaded, RedisLedger

log = logging.getLogger(__name__)


async def record_ledger_mark(conn: asyncpg.Connection, ledger: RedisLedger, seq: int) -> None:
    """Record, in the caller's transaction, the ledger sequence a write other than a decision
    advanced Redis to when it tightened the ledger (a settlement's increases, a late start's
    holds, a pool token's grant or renewal), so that admission never decides on a Redis from
    before it (see migration 0025). 0: nothing was tightened. A number recorded already means
    Redis handed it out twice (it lost a write it had acknowledged): Redis is invalidated, to be
    rebuilt from Postgres, and the caller's transaction fails with LedgerNotLoaded."""
    if not seq:
        return
    if await conn.fetchval(sql("record_ledger_mark"), seq) is None:
        await ledger.invalidate(f"Redis handed out ledger sequence number {seq} again")
        raise LedgerNotLoaded(f"Redis handed out ledger sequence number {seq} again")


@dataclass
class LedgerTransaction:
    conn: asyncpg.Connection
    ledger: RedisLedger
    redis_changed: bool = False
    parked: list[tuple[str, int, str]] = field(default_factory=list)  # (run id, settlement seq, token) begun in Redis


@contextlib.asynccontextmanager
async def ledger_transaction(pool: asyncpg.Pool, ledger: RedisLedger, *, locks_itself: bool = False) -> AsyncIterator[LedgerTransaction]:
    """A transaction holding the ledger lock shared; commits on leaving the block.

    `locks_itself`: the caller's first statement takes the lock (admission's begin_batch does,
    before it reads anything, and long before its Redis call), which saves a round trip per
    transaction on the path every waiting submission is answered after."""
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        work = LedgerTransaction(conn, ledger)
        try:
            if not locks_itself:
                await conn.execute(sql("lock_ledger_shared"))
            yield work
        except BaseException:
            if work.redis_changed:
                # Before the rollback, while the ledger lock is still held: no rebuild ran since
                # the Redis change, so the marker dropped is the one it was made under, never that
                # of a rebuild another process makes once the lock is free (rebuilt again for nothing).
                await ledger.invalidate("a ledger transaction failed after its Redis script")
            with contextlib.suppress(Exception):
                await tx.rollback()
            await _end(ledger, work.parked, committed=False)
            raise
        try:
            await tx.commit()
        except BaseException:
            if work.redis_changed:
                await ledger.invalidate("a ledger transaction's commit failed or was not confirmed")
            raise  # parked settlements wait for end_pending, which asks Postgres
    await _end(ledger, work.parked, committed=True)


async def _end(ledger: RedisLedger, parked: list[tuple[str, int, str]], *, committed: bool) -> None:
    for run_id, seq, token in parked:
        try:
            await ledger.settle_end(run_id, seq=seq, committed=committed, token=token)
        except Exception as exc:  # noqa: BLE001 - left parked: conservative, and ended later
            log.warning("settlement %d of run %r stays parked in Redis (%s); it is ended on the next pass", seq, run_id, exc)
