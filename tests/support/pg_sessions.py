"""What another Postgres session is doing, for tests that interleave sessions: waiting until one
is really running its statement, or waits for a lock another holds, instead of sleeping a guess.

Ask through a connection outside any transaction for pg_stat_activity: within one, Postgres
keeps serving the first look at it (stats_fetch_consistency). pg_locks is read live."""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from tests.support.waiting import wait_for


async def in_pg_sleep(observer: asyncpg.Connection, pid: int) -> bool:
    """Whether the session `pid` is inside a pg_sleep() of its statement (so its statement, and
    its snapshot, are under way)."""
    return bool(await observer.fetchval("SELECT wait_event = 'PgSleep' FROM pg_stat_activity WHERE pid = $1", pid))


async def blocking_someone(observer: asyncpg.Connection, pid: int) -> bool:
    """Whether some session waits for a lock the session `pid` holds."""
    return bool(await observer.fetchval("SELECT EXISTS (SELECT 1 FROM pg_locks WHERE NOT granted AND $1 = ANY(pg_blocking_pids(pid)))", pid))


async def wait_done_or_blocked(task: asyncio.Task[Any], holder: asyncpg.Connection, *, timeout: float = 30) -> None:
    """Wait until `task` is done or waits for a lock `holder`'s open transaction holds (asked
    through `holder` itself: pg_locks is read live, even within its transaction)."""
    pid = holder.get_server_pid()

    async def done_or_blocked() -> bool:
        return task.done() or await blocking_someone(holder, pid)

    await wait_for(done_or_blocked, timeout=timeout, what=f"the task done, or waiting for a lock of session {pid}")
