"""The drift check, incremental: Redis is compared with Postgres a page of ledger keys (and of
runs) at a time, one query and one Redis pipeline per page, without any ledger lock. Only a page
that differs is confirmed under the exclusive ledger lock, for that page's differing entries
alone, so admission is never held for longer than one page.

A difference seen without the lock may be a change in flight: a reservation or settlement in
Redis whose transaction has not committed yet (the lock waits for those), or a settlement parked
between its two halves after its commit (settle_begin.lua; ended by the reconciler, so left out).
A confirmed difference, on a ledger key or on what a run holds, is repaired by rebuilding Redis
from Postgres (rare: it takes a crash or a lost reply). Not in place with Postgres's figures: a
key's figure in Redis also counts holds only Redis knows (a decision that never committed), and
the orphan sweeper gives those back later; a key set to Postgres's figure would give them back
twice. A rebuild drops those holds along with the key's figure.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import asyncpg

from budgetgate.ledger.queries import sql
from budgetgate.ledger.redis_ledger import RedisLedger

log = logging.getLogger(__name__)

PAGE = 500
Figures = tuple[int, int]


@dataclass(frozen=True)
class Drift:
    """Where Redis differs from Postgres: ledger key → ((reserved, consumed) in Redis, in
    Postgres), and run id → (what its Redis run key holds, what Postgres holds for it)."""

    keys: dict[str, tuple[Figures, Figures]] = field(default_factory=dict)
    runs: dict[str, tuple[dict[str, int], dict[str, int]]] = field(default_factory=dict)
    repaired: bool = False

    @property
    def clean(self) -> bool:
        return not self.keys and not self.runs


async def check(
    pool: asyncpg.Pool, redis: RedisLedger, *, repair: bool, rebuild: Callable[[asyncpg.Connection], Awaitable[None]], page: int = PAGE
) -> Drift | None:
    """Compare Redis with Postgres page by page; None when Redis is not loaded."""
    if not await redis.is_loaded():
        return None
    keys: dict[str, tuple[Figures, Figures]] = {}
    runs: dict[str, tuple[dict[str, int], dict[str, int]]] = {}
    repaired = False
    async with pool.acquire() as conn:
        after = ""
        while rows := await conn.fetch(sql("ledger_figures_page"), after, page):
            after = rows[-1]["ledger_key"]
            if _key_drift(_figures(rows), await redis.readings(r["ledger_key"] for r in rows)):
                found = await _confirm_keys(conn, redis, [r["ledger_key"] for r in rows], repair=repair, rebuild=rebuild)
                if found is None:
                    return None
                keys.update(found)
                repaired = repaired or (repair and bool(found))
        # Runs Postgres holds reservations for. Holds only Redis knows (a decision that never
        # committed) are the orphan sweeper's (LedgerSync.sweep_orphans), not scanned for here:
        # a scan walks the whole keyspace, and the check must cost what the ledger holds.
        after = ""
        while ids := [r["run_id"] for r in await conn.fetch(sql("held_runs_page"), after, page)]:
            after = ids[-1]
            runs.update(await _run_page(conn, redis, ids, repair=repair, rebuild=rebuild))
    return Drift(keys, runs, repaired=repaired or (repair and bool(runs)))


def _figures(rows: list[asyncpg.Record]) -> dict[str, Figures]:
    return {r["ledger_key"]: (r["reserved"], r["consumed"]) for r in rows}


def _key_drift(postgres: dict[str, Figures], in_redis: dict[str, Figures]) -> dict[str, tuple[Figures, Figures]]:
    # A key Redis never loaded gets Postgres's figures when first used: not drift.
    return {k: (in_redis[k], pg) for k, pg in postgres.items() if k in in_redis and in_redis[k] != pg}


async def _confirm_keys(
    conn: asyncpg.Connection, redis: RedisLedger, page: list[str], *, repair: bool, rebuild: Callable[[asyncpg.Connection], Awaitable[None]]
) -> dict[str, tuple[Figures, Figures]] | None:
    """Under the exclusive ledger lock (nothing in flight), the page's keys that still differ,
    parked settlements left out; repaired (Redis rebuilt, see the module docstring) when asked.
    None when Redis was invalidated meanwhile."""
    async with conn.transaction():
        await conn.execute(sql("lock_ledger_exclusive"))
        if not await redis.is_loaded():
            return None
        _runs, parked = await redis.parked_scope()
        candidates = [k for k in page if k not in parked]
        confirmed = _key_drift(_figures(await conn.fetch(sql("ledger_figures_of"), candidates)), await redis.readings(candidates))
        if confirmed and repair:
            log.warning("Redis drifted from Postgres on %d ledger key(s); rebuilding it", len(confirmed))
            await rebuild(conn)
        return confirmed


async def _run_page(
    conn: asyncpg.Connection, redis: RedisLedger, run_ids: list[str], *, repair: bool, rebuild: Callable[[asyncpg.Connection], Awaitable[None]]
) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    drifted = await _run_drift(conn, redis, run_ids)
    if not drifted:
        return {}
    async with conn.transaction():
        await conn.execute(sql("lock_ledger_exclusive"))
        if not await redis.is_loaded():
            return {}
        confirmed = await _run_drift(conn, redis, list(drifted))
        if confirmed and repair:
            log.warning("Redis drifted from Postgres on what %d run(s) hold; rebuilding it", len(confirmed))
            await rebuild(conn)
        return confirmed


async def _run_drift(conn: asyncpg.Connection, redis: RedisLedger, run_ids: list[str]) -> dict[str, tuple[dict[str, int], dict[str, int]]]:
    parked, _keys = await redis.parked_scope()
    held: dict[str, dict[str, int]] = {r: {} for r in run_ids}
    for row in await conn.fetch(sql("held_of_runs"), run_ids):
        held[row["run_id"]][row["ledger_key"]] = row["amount"]
    in_redis = await redis.holds_of(run_ids)
    return {r: (in_redis[r], held[r]) for r in run_ids if r not in parked and in_redis[r] != held[r]}
