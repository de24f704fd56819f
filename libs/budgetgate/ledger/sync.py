"""Keep Redis in line with Postgres: Postgres is the truth, Redis a live copy for atomic checks."""

from __future__ import annotations

import asyncio
import uuid
from collections import defaultdict

import asyncpg

from budgetgate.ledger.queries import sql
from budgetgate.ledger.redis_ledger import RedisLedger


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
