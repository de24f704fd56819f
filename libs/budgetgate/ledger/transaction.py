"""A unit of change to the ledger (a batch of admission decisions, a reconciler settlement): one
Postgres transaction holding the ledger lock (shared) from before its Redis call until its commit, so a rebuild of Redis from Postgres
never misses a change Redis has seen.

A settlement goes to Redis in two halves around the commit (settle_begin.lua / settle_end.lua):
the increases before, the decreases after, so Redis never shows more room than Postgres holds.
After a rollback its increases are taken back; when the commit cannot be confirmed, or this
process dies in between, the parked half waits for `Settler.end_pending`, which asks Postgres.
Any other Redis change whose transaction fails invalidates the Redis ledger, to be rebuilt."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import asyncpg

from budgetgate.ledger.queries import sql
from budgetgate.ledger.redis_ledger import LedgerNotLoaded, RedisLedger

log = logging.getLogger(__name__)


async def committed_seq(conn: asyncpg.Connection | asyncpg.Pool, ledger: RedisLedger) -> int:
    """The highest ledger sequence Postgres committed of `ledger`'s shard: a Redis shard behind it
    lost a write Postgres holds, and its scripts refuse to decide on it (reserve.lua). Read in a
    statement of its own after the ledger lock, or its snapshot would predate the lock."""
    return int(await conn.fetchval(sql("committed_shard_seq"), ledger.shard, ledger.shards.count))


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
    parked: list[tuple[str, int, str]] = field(default_factory=list)  # (run id, settlement seq, token) begun in Redis
    # The pools' shard on a ledger of several shards (it may be `ledger`'s too): a run's pool
    # token is there, apart from its holds (concurrency_holds.end_run_holds, renew_run_token);
    # locked shared with `ledger`.
    pools: RedisLedger | None = None
    # Every shard the unit changed in Redis, by number: invalidated should it fail (`changing`).
    changed: dict[int, RedisLedger] = field(default_factory=dict)

    def changing(self, *ledgers: RedisLedger | None) -> None:
        """Mark shards the unit changes in Redis (None: none), before the call that changes them:
        a script may run and its reply be lost. Should the unit fail, each is invalidated while
        its ledger lock is still held (see RedisLedger.invalidate)."""
        for ledger in ledgers:
            if ledger is not None:
                self.changed[ledger.shard] = ledger

    @property
    def tokens(self) -> RedisLedger:
        """The shard a run's pool token is on: the pools' on a ledger of several shards, else the unit's own."""
        return self.pools or self.ledger

    def unchanged(self, ledger: RedisLedger) -> None:
        """Unmark a shard whose script answered that it changed nothing."""
        self.changed.pop(ledger.shard, None)

    async def invalidate_changed(self, why: str) -> None:
        """Invalidate every shard the unit changed."""
        for ledger in list(self.changed.values()):
            await ledger.invalidate(why)


@contextlib.asynccontextmanager
async def ledger_transaction(pool: asyncpg.Pool, ledger: RedisLedger, *, pools: RedisLedger | None = None) -> AsyncIterator[LedgerTransaction]:
    """A transaction holding the ledger lock shared; commits on leaving the block. `pools`: the
    pools' shard of a ledger of several shards (LedgerTransaction.pools), its lock taken with
    `ledger`'s in shard order (as every unit locking several shards does)."""
    async with pool.acquire() as conn:
        tx = conn.transaction()
        await tx.start()
        work = LedgerTransaction(conn, ledger, pools=pools)
        try:
            if work.pools is None:
                await conn.execute(sql("lock_ledger_shared"), ledger.shard)
            else:
                await conn.execute(sql("lock_shards_shared"), sorted({ledger.shard, work.pools.shard}))
            yield work
        except BaseException:
            # Before the rollback, while the ledger lock is still held: no rebuild ran since
            # the Redis change, so the marker dropped is the one it was made under, never that
            # of a rebuild another process makes once the lock is free (rebuilt again for nothing).
            await work.invalidate_changed("a ledger transaction failed after its Redis script")
            with contextlib.suppress(Exception):
                await tx.rollback()
            await _end(ledger, work.parked, committed=False)
            raise
        try:
            await tx.commit()
        except BaseException:
            await work.invalidate_changed("a ledger transaction's commit failed or was not confirmed")
            raise  # parked settlements wait for end_pending, which asks Postgres
    await _end(ledger, work.parked, committed=True)


# Sessions whose locks are being let go after their unit committed (ledger_session), kept so
# that the tasks are not collected before they ran.
_letting_go: set[asyncio.Task[None]] = set()


@contextlib.asynccontextmanager
async def ledger_session(pool: asyncpg.Pool, ledger: RedisLedger) -> AsyncIterator[LedgerTransaction]:
    """A unit of change to the ledger with no transaction block, for admission's decisions: as
    ledger_transaction, in three round trips instead of five.

    The caller's first statement takes the ledger lock (shared) and its other locks at session
    level (budgetgate_begin_decisions), so they hold across statements that each commit on their
    own; its one write of the unit is one statement, which commits it (an implicit transaction:
    no BEGIN, no COMMIT). Under READ COMMITTED every statement took a fresh snapshot anyway, so
    the reads see what they saw inside a transaction; what the locks serialise stays serialised,
    as they are let go only after the write committed.

    They are let go after the block, in the background: whoever waits on the unit's answer does
    not wait for that round trip. A connection whose locks cannot be let go is closed (its
    session's locks end with it), never returned to the pool holding them. On failure, a Redis
    change whose write did not commit, or might have, invalidates the Redis ledger before the
    locks are let go, as in ledger_transaction: each shard the unit marked changed
    (LedgerTransaction.changing), whichever shards those are. `ledger`: the shard the unit works
    on (for a unit working on several, any of them: the marks say which to invalidate)."""
    conn = await pool.acquire()
    work = LedgerTransaction(conn, ledger)
    try:
        yield work
    except BaseException:
        try:
            await work.invalidate_changed("a ledger unit failed after its Redis script, before its write committed or with the commit unconfirmed")
        finally:
            await _let_go(pool, conn)
        raise
    task = asyncio.get_running_loop().create_task(_let_go(pool, conn), name="let-go-of-ledger-locks")
    _letting_go.add(task)
    task.add_done_callback(_letting_go.discard)


async def _let_go(pool: asyncpg.Pool, conn: asyncpg.Connection) -> None:
    """Let go of the session locks of `conn` and give it back to `pool`; when that fails, close
    it: its locks end with its session."""
    try:
        await conn.execute(sql("let_go_of_session_locks"))
    except BaseException as exc:
        log.warning("could not let go of a ledger session's locks (%s: %s); its connection is closed instead", type(exc).__name__, exc)
        conn.terminate()
        if not isinstance(exc, Exception):
            raise
    finally:
        await pool.release(conn)


async def _end(ledger: RedisLedger, parked: list[tuple[str, int, str]], *, committed: bool) -> None:
    for run_id, seq, token in parked:
        try:
            await ledger.settle_end(run_id, seq=seq, committed=committed, token=token)
        except Exception as exc:  # noqa: BLE001 - left parked: conservative, and ended later
            log.warning("settlement %d of run %r stays parked in Redis (%s); it is ended on the next pass", seq, run_id, exc)
