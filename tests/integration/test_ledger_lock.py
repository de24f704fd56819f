"""The ledger lock on real Postgres: a transaction that changes reservations holds it shared from
its first statement to its commit, so a Redis rebuild (which takes it exclusively) can never
read Postgres between a reservation made in Redis and its commit. Admission's batch
transaction does not take it in a statement of its own: begin_batch takes it first thing."""

from __future__ import annotations

import asyncpg
import pytest

from budgetgate.ledger.queries import owned_by
from budgetgate.ledger.redis_ledger import RedisLedger
from budgetgate.ledger.transaction import ledger_transaction
from budgetgate.runtime import redis_client

sql = owned_by("budgetgate.services.admission")  # its own queries, then the shared ledger's

# Advisory locks are per database; other tests' databases hold their own.
HELD_SHARED = """SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND classid = 7301 AND objid = 0 AND mode = 'ShareLock' AND granted
                 AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"""


@pytest.mark.parametrize("locks_itself", [False, True], ids=["own-statement", "begin-batch"])
async def test_a_ledger_transaction_keeps_a_rebuild_out_until_it_commits(pg_dsn: str, redis_url: str, redis_prefix: str, locks_itself: bool) -> None:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    client = redis_client.connect(redis_url)
    rebuild = await asyncpg.connect(pg_dsn)
    try:
        async with ledger_transaction(pool, RedisLedger(client, prefix=redis_prefix), locks_itself=locks_itself) as work:
            if locks_itself:
                await work.conn.fetch(sql("begin_batch"), ["run-a", "run-b"])  # what admission's batch does first
            assert await rebuild.fetchval(HELD_SHARED) == 1
            async with rebuild.transaction():
                assert await rebuild.fetchval("SELECT pg_try_advisory_xact_lock(7301, 0)") is False  # a rebuild waits
        assert await rebuild.fetchval(HELD_SHARED) == 0
        async with rebuild.transaction():
            assert await rebuild.fetchval("SELECT pg_try_advisory_xact_lock(7301, 0)") is True
    finally:
        await rebuild.close()
        await client.aclose()
        await pool.close()
