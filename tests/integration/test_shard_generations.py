"""Each shard of the Redis ledger numbers its own generation (budgetgate.core.shards), on real
Postgres and Redis: two shards of one ledger hand out numbers that never meet, Postgres reads
each shard's committed sequence from its residue, and a shard behind what Postgres committed of
it is refused and rebuilt while the other decides on. A ledger suite: on a Redis Cluster the two
shards' tags hash to different slots."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import pytest

from budgetgate.core.shards import SEQ_STEP
from budgetgate.ledger.redis_ledger import ChargeRequest, LedgerNotLoaded, RedisLedger, Reservation
from budgetgate.ledger.redis_sync import LedgerSync
from budgetgate.ledger.transaction import committed_seq, record_ledger_mark
from budgetgate.runtime import redis_client

NOW_MS = 1_796_000_000_000
KEY = "ns=team|2026-11-01T00:00:00Z/2026-12-01T00:00:00Z|gpu_hours"


@dataclass
class Shard:
    ledger: RedisLedger
    sync: LedgerSync


@pytest.fixture
async def shards(pg_dsn: str, redis_url: str, redis_prefix: str) -> AsyncIterator[tuple[asyncpg.Pool, list[Shard]]]:
    client = redis_client.connect(redis_url)
    async with asyncpg.create_pool(pg_dsn, min_size=1, max_size=4) as pool:
        try:
            made = [Shard(ledger, LedgerSync(pool, ledger)) for ledger in (RedisLedger(client, prefix=redis_prefix, shard=i, shards=2) for i in range(2))]
            for shard in made:
                await shard.sync.rebuild(force=True)
            yield pool, made
        finally:
            await client.aclose()


async def reserve(pool: asyncpg.Pool, ledger: RedisLedger, amount: int = 1) -> int:
    """A reservation on the shard's copy of KEY, its number recorded in Postgres as a decision's
    would be; the number."""
    async with pool.acquire() as conn, conn.transaction():
        await ledger.load_key(KEY, reserved=0, consumed=0)
        asked = Reservation(f"run-{uuid.uuid4().hex[:8]}", str(uuid.uuid4()), (ChargeRequest(KEY, amount, 10**9, True),))
        [result] = await ledger.reserve_batch([asked], now_ms=NOW_MS, committed_seq=await committed_seq(conn, ledger))
        assert result.status == "RESERVED" and result.seq is not None
        await record_ledger_mark(conn, ledger, result.seq)
        return result.seq


async def test_the_numbers_of_two_shards_never_meet(shards) -> None:
    pool, (zero, one) = shards
    assert (zero.ledger.tag, one.ledger.tag) == ("{" + zero.ledger.shards.prefix + ":0}", "{" + one.ledger.shards.prefix + ":1}")

    handed = await asyncio.gather(*(reserve(pool, s.ledger) for _ in range(10) for s in (zero, one)))
    by_shard = {0: sorted(handed[0::2]), 1: sorted(handed[1::2])}
    assert len(set(handed)) == 20
    assert all(seq % SEQ_STEP == shard for shard, seqs in by_shard.items() for seq in seqs)
    assert by_shard[1] == [1 + SEQ_STEP * n for n in range(1, 11)]  # from its residue, by the step
    async with pool.acquire() as conn:
        assert [await committed_seq(conn, s.ledger) for s in (zero, one)] == [by_shard[0][-1], by_shard[1][-1]]
        assert await conn.fetchval("SELECT budgetgate_committed_ledger_seq()") == max(handed)


async def test_a_shard_behind_is_refused_and_rebuilt_while_the_other_decides_on(shards) -> None:
    pool, (zero, one) = shards
    first = await reserve(pool, one.ledger)
    await reserve(pool, one.ledger)
    await reserve(pool, zero.ledger)

    # Shard 1's master fails over to a replica that missed its last reservation.
    await one.ledger.client.set(one.ledger.sequence, first)
    with pytest.raises(LedgerNotLoaded):
        await reserve(pool, one.ledger)
    assert not await one.ledger.is_loaded()  # it invalidated itself
    assert await zero.ledger.is_loaded()
    await reserve(pool, zero.ledger)  # the other shard is not behind: it decides on

    await one.sync.rebuild(force=False)
    async with pool.acquire() as conn:
        committed = await committed_seq(conn, one.ledger)
    after = await reserve(pool, one.ledger)
    assert after == committed + SEQ_STEP and after % SEQ_STEP == 1


async def test_rebuilding_one_shard_leaves_the_other_shards_keys(shards) -> None:
    pool, (zero, one) = shards
    await reserve(pool, zero.ledger, amount=7)
    await one.sync.rebuild(force=True)
    assert await zero.ledger.readings([KEY]) == {KEY: (7, 0)}  # held in Redis, its run's decision in flight
    assert await zero.ledger.is_loaded()
