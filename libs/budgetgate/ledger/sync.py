"""Keep Redis in line with Postgres: Postgres is the truth, Redis a live copy for atomic checks."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import defaultdict
from datetime import datetime, timedelta

import asyncpg

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
            ledgers = {r["ledger_key"]: (r["reserved"], r["consumed"]) for r in await conn.fetch(sql("all_ledger_figures"))}
            runs: dict[str, tuple[str, int, dict[str, int]]] = {}
            amounts: dict[str, dict[str, int]] = defaultdict(dict)
            for row in await conn.fetch(sql("held_reservations")):
                amounts[row["run_id"]][row["ledger_key"]] = row["amount"]
                runs[row["run_id"]] = (str(row["decision_id"]), int(row["created_at"].timestamp() * 1000), amounts[row["run_id"]])
            await self.redis.replace_all(ledgers=ledgers, runs=runs, generation=uuid.uuid4().hex)
        return True

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


def _uuid(text: str) -> uuid.UUID | None:
    try:
        return uuid.UUID(text)
    except ValueError:
        return None
