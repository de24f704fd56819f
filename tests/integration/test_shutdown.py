"""Stopping is bounded: a client whose server went away, or a pool whose connection is still held,
is abandoned after its timeout instead of keeping a service (or a test's teardown) from ending."""

from __future__ import annotations

import asyncio
import time

import asyncpg
import pytest

from budgetgate.edge.serving import close_pool, close_within

pytestmark = pytest.mark.integration


async def test_a_pool_with_a_connection_still_held_is_terminated_after_its_timeout(pg_dsn) -> None:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    held = await pool.acquire()  # never given back, as by a request still in flight
    started = time.monotonic()
    await close_pool(pool, timeout=0.5)
    assert time.monotonic() - started < 5
    assert pool.is_closing()
    with pytest.raises(asyncpg.InterfaceError):
        await held.fetchval("SELECT 1")  # its connection went with the pool


async def test_a_pool_given_back_closes_normally(pg_dsn) -> None:
    pool = await asyncpg.create_pool(pg_dsn, min_size=1, max_size=2)
    async with pool.acquire() as conn:
        assert await conn.fetchval("SELECT 1") == 1
    await close_pool(pool, timeout=5)
    assert pool.is_closing()


async def test_a_close_that_hangs_or_fails_is_logged_and_abandoned(caplog) -> None:
    started = time.monotonic()
    await close_within(asyncio.Event().wait(), what="a producer", timeout=0.2)

    async def broken() -> None:
        raise ConnectionResetError("server went away")

    await close_within(broken(), what="a consumer")
    assert time.monotonic() - started < 5
    messages = [r.getMessage() for r in caplog.records]
    assert "a producer did not close cleanly: TimeoutError" in messages
    assert "a consumer did not close cleanly: server went away" in messages
