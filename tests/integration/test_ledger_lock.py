"""The ledger lock on real Postgres: a unit of change to the reservations holds it shared from
its first statement until its write committed, so a Redis rebuild (which takes it exclusively)
can never read Postgres between a reservation made in Redis and its commit.

Two shapes: ledger_transaction (the reconciler's, a transaction block taking the lock in a
statement of its own) and ledger_session (admission's: begin_batch takes the ledger lock and the
runs' locks at session level, each statement commits on its own, and the locks are let go after
the block, in the background, or at once when it fails)."""

from __future__ import annotations

import asyncpg

from budgetgate.ledger.queries import owned_by
from budgetgate.ledger.redis_ledger import RedisLedger
from budgetgate.ledger.transaction import ledger_session, ledger_transaction
from budgetgate.runtime import redis_client
from tests.support.waiting import wait_for

sql = owned_by("budgetgate.services.admission")  # its own queries, then the shared ledger's

# Advisory locks are per database; other tests' databases hold their own.
HELD = """SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = $1 AND granted
          AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"""
LEDGER, RUNS = 7301, 7302


async def _rebuild_waits(rebuild: asyncpg.Connection) -> bool:
    async with rebuild.transaction():
        return await rebuild.fetchval("SELECT pg_try_advisory_xact_lock(7301, 0)") is False


async def test_a_ledger_transaction_keeps_a_rebuild_out_until_it_commits(pg_dsn: str, redis_url: str, redis_prefix: str) -> None:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    client = redis_client.connect(redis_url)
    rebuild = await asyncpg.connect(pg_dsn)
    try:
        async with ledger_transaction(pool, RedisLedger(client, prefix=redis_prefix)):
            assert await rebuild.fetchval(HELD, LEDGER) == 1
            assert await _rebuild_waits(rebuild)
        assert await rebuild.fetchval(HELD, LEDGER) == 0
        assert not await _rebuild_waits(rebuild)
    finally:
        await rebuild.close()
        await client.aclose()
        await pool.close()


async def test_the_release_befores_begin_batch_still_takes_transaction_scoped_locks(pg_dsn: str) -> None:
    """Processes of the release before call budgetgate_begin_batch in a transaction block and
    never let go of locks themselves: its locks must end with that transaction, as they did."""
    conn = await asyncpg.connect(pg_dsn)
    observer = await asyncpg.connect(pg_dsn)
    try:
        async with conn.transaction():
            rows = await conn.fetch("SELECT * FROM budgetgate_begin_batch($1::text[])", ["run-a", "run-b"])
            assert rows[0]["committed_seq"] is not None and len(rows) == 1  # the ledger's row; no decisions yet
            assert (await observer.fetchval(HELD, LEDGER), await observer.fetchval(HELD, RUNS)) == (1, 2)
        assert await _none_held(observer)
    finally:
        await observer.close()
        await conn.close()


async def test_a_ledger_session_holds_its_locks_across_its_statements_and_lets_go_after_its_block(pg_dsn: str, redis_url: str, redis_prefix: str) -> None:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=1)
    client = redis_client.connect(redis_url)
    rebuild = await asyncpg.connect(pg_dsn)
    try:
        async with ledger_session(pool, RedisLedger(client, prefix=redis_prefix)) as work:
            await work.conn.fetch(sql("begin_batch"), ["run-a", "run-b"], [0], 1)  # what admission's batch does first
            await work.conn.execute("CREATE TABLE session_wrote (x int); INSERT INTO session_wrote VALUES (1)")  # commits on its own
            assert await rebuild.fetchval("SELECT count(*) FROM session_wrote") == 1
            assert (await rebuild.fetchval(HELD, LEDGER), await rebuild.fetchval(HELD, RUNS)) == (1, 2)  # after that commit, still held
            assert await _rebuild_waits(rebuild)
        await wait_for(lambda: _none_held(rebuild), timeout=10, what="the session's locks let go")
        assert not await _rebuild_waits(rebuild)
        async with pool.acquire() as again:  # the one connection, back in the pool, holding nothing
            assert await again.fetchval("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()") == 0
    finally:
        await rebuild.execute("DROP TABLE IF EXISTS session_wrote")
        await rebuild.close()
        await client.aclose()
        await pool.close()


async def test_a_failed_ledger_session_invalidates_redis_and_lets_go_before_it_raises(pg_dsn: str, redis_url: str, redis_prefix: str) -> None:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=1)
    client = redis_client.connect(redis_url)
    ledger = RedisLedger(client, prefix=redis_prefix)
    rebuild = await asyncpg.connect(pg_dsn)
    await client.set(ledger.marker, "1")
    try:
        try:
            async with ledger_session(pool, ledger) as work:
                await work.conn.fetch(sql("begin_batch"), ["run-a"], [0], 1)
                work.changing(work.ledger)  # reserved in Redis, then the write fails
                await work.conn.execute("SELECT no_such_column FROM ledger_entries")
        except asyncpg.UndefinedColumnError:
            pass
        else:
            raise AssertionError("the failure was not raised")
        assert await _none_held(rebuild)  # at once: the rebuild that follows must not wait for them
        assert not await ledger.is_loaded()
    finally:
        await rebuild.close()
        await client.aclose()
        await pool.close()


async def test_a_session_whose_locks_cannot_be_let_go_is_closed_not_pooled(pg_dsn: str, redis_url: str, redis_prefix: str) -> None:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=1)
    client = redis_client.connect(redis_url)
    observer = await asyncpg.connect(pg_dsn)
    try:
        async with ledger_session(pool, RedisLedger(client, prefix=redis_prefix)) as work:
            await work.conn.fetch(sql("begin_batch"), ["run-a"], [0], 1)
            lost = work.conn.get_server_pid()
            # The session ends before its locks can be let go (a server restart, a proxy's cut).
            assert await observer.fetchval("SELECT pg_terminate_backend($1)", lost)
        await wait_for(lambda: _none_held(observer), timeout=10, what="its locks gone with its session")
        assert await pool.fetchval("SELECT pg_backend_pid()") != lost  # the pool replaced it
    finally:
        await observer.close()
        await client.aclose()
        await pool.close()


async def _none_held(conn: asyncpg.Connection) -> bool:
    return await conn.fetchval(HELD, LEDGER) == 0 and await conn.fetchval(HELD, RUNS) == 0


async def test_each_shard_has_its_ledger_lock_and_an_override_takes_every_shards(pg_dsn: str) -> None:
    """A rebuild of shard 1 (its lock held exclusively) holds back the batches touching shard 1
    and no other; a tenant override or a budget grant takes every shard's lock, so it waits for a
    batch of any shard in flight."""
    rebuild, batch, override = [await asyncpg.connect(pg_dsn) for _ in range(3)]
    try:
        async with rebuild.transaction():
            await rebuild.execute(sql("lock_ledger_exclusive"), 1)
            async with batch.transaction():
                await batch.fetch("SELECT * FROM budgetgate_begin_decisions($1::text[], ARRAY[0], 2)", ["run-a"])  # shard 0: not held back
                await batch.execute("SELECT pg_advisory_unlock_all()")
            async with batch.transaction():
                await batch.execute("SET LOCAL lock_timeout = '200ms'")
                try:
                    await batch.fetch("SELECT * FROM budgetgate_begin_decisions($1::text[], ARRAY[0, 1], 2)", ["run-b"])
                    raise AssertionError("a batch of shard 1 went past its rebuild")
                except asyncpg.LockNotAvailableError:
                    pass
        await batch.fetch("SELECT * FROM budgetgate_begin_decisions($1::text[], ARRAY[1], 2)", ["run-b"])  # session locks: held on
        async with override.transaction():
            await override.execute("SET LOCAL lock_timeout = '200ms'")
            try:
                await override.execute(sql("lock_ledger_everywhere"))
                raise AssertionError("an override went past a batch in flight on shard 1")
            except asyncpg.LockNotAvailableError:
                pass
        await batch.execute("SELECT pg_advisory_unlock_all()")
        async with override.transaction():
            await override.execute(sql("lock_ledger_everywhere"))
    finally:
        for conn in (rebuild, batch, override):
            await conn.close()
