"""Keep Redis in line with Postgres: Postgres is the truth, Redis a live copy for atomic checks."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import asyncpg

from budgetgate.ledger.concurrency import concurrency_state, write_concurrency
from budgetgate.ledger.queries import sql
from budgetgate.ledger.redis_ledger import RedisLedger

log = logging.getLogger(__name__)


class LedgerSync:
    """Rebuilds the Redis ledger from Postgres when it was lost (restart, flush, first start)."""

    def __init__(self, pool: asyncpg.Pool, redis_ledger: RedisLedger) -> None:
        self.pool = pool
        self.redis = redis_ledger
        self._lock = asyncio.Lock()

    async def ensure_loaded(self) -> bool:
        """Rebuild unless Redis holds the ledger; True when this call rebuilt it."""
        if await self.redis.is_loaded():
            return False
        async with self._lock:  # one rebuild per process at a time; others wait for it
            return await self.rebuild(force=False)

    async def rebuild(self, *, force: bool) -> bool:
        """Replace Redis's ledger with Postgres's. Without `force`, skips when already loaded.

        Holds the ledger lock exclusively: every transaction that reserves holds it shared from
        before its Redis call until its commit, so the snapshot read here includes every
        reservation Redis could have counted.
        """
        async with self.pool.acquire() as conn, conn.transaction():
            await conn.execute(sql("lock_ledger_exclusive"))
            if not force and await self.redis.is_loaded():
                return False
            await self._replace(conn)
        return True

    async def _replace(self, conn: asyncpg.Connection) -> None:
        """Write Postgres's ledger to Redis; the caller holds the ledger lock exclusively."""
        ledgers, runs = await _postgres_state(conn)
        held = await concurrency_state(conn, self.redis.keys, now=datetime.now(UTC))
        await self.redis.replace_all(ledgers=ledgers, runs=runs, generation=uuid.uuid4().hex, extra=lambda pipe: write_concurrency(pipe, self.redis.keys, held))

    async def check_drift(self, *, repair: bool) -> Drift | None:
        """Compare Redis with Postgres (Postgres is the truth); None when Redis is not loaded.

        A difference seen without locks may be a change in flight (in Redis, not yet committed),
        so it is confirmed under the exclusive ledger lock, when nothing is in flight; with
        `repair`, a confirmed difference is repaired by rebuilding Redis within that same lock.
        """
        if not await self.redis.is_loaded():
            return None
        async with self.pool.acquire() as conn:
            first = await self._compare(conn)
            if first.clean:
                return first
            async with conn.transaction():
                await conn.execute(sql("lock_ledger_exclusive"))
                if not await self.redis.is_loaded():
                    return None
                confirmed = await self._compare(conn)
                if not confirmed.clean and repair:
                    log.warning("Redis drifted from Postgres on %d ledger key(s) and %d run(s); rebuilding it", len(confirmed.keys), len(confirmed.runs))
                    await self._replace(conn)
                    return Drift(confirmed.keys, confirmed.runs, repaired=True)
                return confirmed

    async def _compare(self, conn: asyncpg.Connection) -> Drift:
        ledgers, runs = await _postgres_state(conn)
        in_redis = await self.redis.all_readings()
        keys = {}
        for key in sorted(set(ledgers) | set(in_redis)):
            redis_figures, pg_figures = in_redis.get(key), ledgers.get(key, (0, 0))
            # A key Redis never loaded gets Postgres's figures when first used: not drift.
            if redis_figures is not None and redis_figures != pg_figures:
                keys[key] = (redis_figures, pg_figures)
        held = {run_id: amounts for run_id, (_decision, _at, amounts) in runs.items()}
        redis_runs = await self.redis.run_holds()
        drifted_runs = {
            run_id: (redis_runs.get(run_id, {}), held.get(run_id, {}))
            for run_id in sorted(set(held) | set(redis_runs))
            if redis_runs.get(run_id, {}) != held.get(run_id, {})
        }
        return Drift(keys, drifted_runs)

    async def sweep_orphans(self, *, grace: timedelta, now: datetime) -> list[str]:
        """Release Redis holds older than `grace` whose decision never reached Postgres (the
        process died between reserving and committing). Returns the run ids released."""
        cutoff_ms = int((now - grace).timestamp() * 1000)
        released = []
        for run_id, (decision_id, at_ms) in (await self.redis.held_runs()).items():
            if at_ms > cutoff_ms:
                continue
            async with self.pool.acquire() as conn, conn.transaction():
                # The run's lock: a retry of this run deciding right now finishes first.
                await conn.execute(sql("lock_ledger_shared"))
                await conn.execute(sql("lock_run"), run_id)
                known = await conn.fetchval("SELECT 1 FROM decisions WHERE decision_id = $1", _uuid(decision_id))
                if known:
                    continue
                if await self.redis.release(run_id, decision_id=decision_id):
                    log.warning("released orphaned reservation of run %r (decision %s never committed)", run_id, decision_id)
                    released.append(run_id)
        return released


@dataclass(frozen=True)
class Drift:
    """Where Redis differs from Postgres: ledger key → ((reserved, consumed) in Redis, in
    Postgres), and run id → (what its Redis run key holds, what Postgres holds for it)."""

    keys: dict[str, tuple[tuple[int, int], tuple[int, int]]] = field(default_factory=dict)
    runs: dict[str, tuple[dict[str, int], dict[str, int]]] = field(default_factory=dict)
    repaired: bool = False

    @property
    def clean(self) -> bool:
        return not self.keys and not self.runs


async def _postgres_state(conn: asyncpg.Connection) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[str, int, dict[str, int]]]]:
    """Every ledger key's (reserved, consumed), and every run's held amounts, from Postgres."""
    ledgers = {r["ledger_key"]: (r["reserved"], r["consumed"]) for r in await conn.fetch(sql("all_ledger_figures"))}
    runs: dict[str, tuple[str, int, dict[str, int]]] = {}
    amounts: dict[str, dict[str, int]] = defaultdict(dict)
    for row in await conn.fetch(sql("held_reservations")):
        amounts[row["run_id"]][row["ledger_key"]] = row["amount"]
        runs[row["run_id"]] = (str(row["decision_id"]), int(row["created_at"].timestamp() * 1000), amounts[row["run_id"]])
    return ledgers, runs


def _uuid(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text)
    except ValueError:
        return None


async def undo_unless_committed(ledger: RedisLedger, *, committed: Callable[[], Awaitable[object]], undo: Callable[[], Awaitable[object]], what: str) -> None:
    """After a failure that followed a Redis change: undo the change when Postgres is known not to
    hold its row; when that cannot be known, invalidate Redis so it is rebuilt from Postgres."""
    try:
        if not await committed():
            await undo()
    except Exception as exc:  # noqa: BLE001 - any failure here leaves us unsure
        await ledger.invalidate(f"cannot tell whether {what} committed: {exc}")
