"""Two batches that create the same new ledger entries (the first submissions of a new window)
never deadlock on them, whatever order their plans list the keys in: ensure_ledger_entries
inserts in key order, as record_decisions does. Each row's insert is slowed by a test trigger,
so the two statements interleave key by key as they would under load."""

from __future__ import annotations

import asyncio

import asyncpg
import orjson

from budgetgate.ledger.queries import owned_by

sql = owned_by("budgetgate.services.admission")  # its own queries, then the shared ledger's


def _entries(*keys: str) -> str:
    return orjson.dumps(
        [
            {
                "ledger_key": key,
                "scope_id": "s",
                "unit": "gpu_hours",
                "window_key": "2026-12",
                "window_start": "2026-12-01T00:00:00+00:00",
                "window_end": "2027-01-01T00:00:00+00:00",
                "policy_id": key,
                "policy_git_sha": "a" * 40,
                "limit_amount": 100,
            }
            for key in keys
        ]
    ).decode()


async def test_two_batches_creating_the_same_keys_in_opposite_orders_do_not_deadlock(pg_dsn: str) -> None:
    setup = await asyncpg.connect(pg_dsn)
    try:
        await setup.execute(
            "CREATE FUNCTION slow_entry() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN PERFORM pg_sleep(0.3); RETURN NEW; END $$; "
            "CREATE TRIGGER slow_entry BEFORE INSERT ON ledger_entries FOR EACH ROW EXECUTE FUNCTION slow_entry()"
        )
    finally:
        await setup.close()
    first, second = await asyncpg.connect(pg_dsn), await asyncpg.connect(pg_dsn)
    try:

        async def batch(conn: asyncpg.Connection, keys: tuple[str, ...], delay: float) -> None:
            async with conn.transaction():
                await asyncio.sleep(delay)  # the scenario: the second batch starts while the first is inserting
                await conn.execute(sql("ensure_ledger_entries"), _entries(*keys))
                await asyncio.sleep(0.2)  # the batch's other work (simulated), its locks held

        # Listed in plan order, one the reverse of the other: inserted as listed, the first held
        # k-a and waited for k-b, which the second held while it waited for k-a.
        await asyncio.wait_for(asyncio.gather(batch(first, ("k-a", "k-b"), 0.0), batch(second, ("k-b", "k-a"), 0.15)), 30)
        assert await first.fetchval("SELECT array_agg(ledger_key ORDER BY ledger_key) FROM ledger_entries") == ["k-a", "k-b"]
    finally:
        await first.close()
        await second.close()


async def test_existing_entries_are_left_as_they_are(pg_dsn: str) -> None:
    conn = await asyncpg.connect(pg_dsn)
    try:
        await conn.execute(sql("ensure_ledger_entries"), _entries("k-a"))
        await conn.execute("UPDATE ledger_entries SET consumed = 7 WHERE ledger_key = 'k-a'")
        other = await asyncpg.connect(pg_dsn)
        try:
            async with other.transaction():
                await other.execute("UPDATE ledger_entries SET consumed = 8 WHERE ledger_key = 'k-a'")  # a settlement under way
                # Not waited for: the key is there already, so it is skipped before inserting.
                await asyncio.wait_for(conn.execute(sql("ensure_ledger_entries"), _entries("k-a", "k-c")), 5)
        finally:
            await other.close()
        assert dict(await conn.fetch("SELECT ledger_key, consumed FROM ledger_entries ORDER BY 1")) == {"k-a": 8, "k-c": 0}
    finally:
        await conn.close()
