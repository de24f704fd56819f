"""Keep Redis in line with Postgres: Postgres is the truth, Redis a live copy for atomic checks."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections import defaultdict
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

import asyncpg

from budgetgate.ledger import drift, rewrite
from budgetgate.ledger.concurrency_holds import concurrency_state, write_concurrency
from budgetgate.ledger.drift import Drift
from budgetgate.ledger.queries import sql
from budgetgate.ledger.redis_ledger import LedgerNotLoaded, RedisLedger
from budgetgate.ledger.transaction import committed_seq

log = logging.getLogger(__name__)


# How often a process waiting for another one's rebuild looks again.
POLL_SECONDS = 0.05


class RebuildWaitExceeded(LedgerNotLoaded):
    """Redis was not rebuilt within the time allowed to wait for it: answer 503 and retry later."""


class LedgerSync:
    """Rebuilds the Redis ledger from Postgres when it was lost (restart, flush, first start).

    Several processes (admission instances, the reconciler) may find it lost at once: one of them
    is elected (a Postgres advisory lock, tried without waiting, held until its transaction ends,
    so a rebuilder that dies gives it up with its connection) and rebuilds; the others look again
    every POLL_SECONDS for up to `wait` seconds, taking over if the election is free again, and
    decide once Redis is loaded. Past `wait` they raise RebuildWaitExceeded.
    """

    def __init__(self, pool: asyncpg.Pool, redis_ledger: RedisLedger, *, wait: float = 5.0) -> None:
        self.pool = pool
        self.redis = redis_ledger
        self.wait = wait
        self.rebuilds = 0  # rebuilds this process made (drift repairs included), for /metrics
        self._lock = asyncio.Lock()

    async def ensure_loaded(self) -> bool:
        """Rebuild unless Redis holds the ledger, or wait for the process rebuilding it; True when
        this call rebuilt it. Raises RebuildWaitExceeded when it is not loaded within `wait`."""
        if await self.redis.is_loaded():
            return False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.wait
        try:
            async with asyncio.timeout(self.wait):
                await self._lock.acquire()  # one task per process asks; the others wait for it
        except TimeoutError:
            raise self._waited() from None
        try:
            while True:
                if await self.redis.is_loaded():
                    return False
                rebuilt = await self._rebuild(force=False, elect=True)
                if rebuilt is not None:
                    return rebuilt
                if loop.time() >= deadline:
                    raise self._waited()
                await asyncio.sleep(min(POLL_SECONDS, deadline - loop.time()))
        finally:
            self._lock.release()

    def _waited(self) -> RebuildWaitExceeded:
        return RebuildWaitExceeded(f"the Redis ledger is being rebuilt from Postgres and was not ready within {self.wait:g} s; retry shortly")

    async def rebuild(self, *, force: bool) -> bool:
        """Replace Redis's ledger with Postgres's. Without `force`, skips when already loaded."""
        return bool(await self._rebuild(force=force, elect=False))

    async def _rebuild(self, *, force: bool, elect: bool) -> bool | None:
        """Rebuild under the ledger lock; None when `elect` and another process is rebuilding.

        Holds the ledger lock exclusively: every transaction that reserves holds it shared from
        before its Redis call until its commit, so the snapshot read here includes every
        reservation Redis could have counted.
        """
        async with self.pool.acquire() as conn, conn.transaction():
            if elect and not await conn.fetchval(sql("elect_rebuilder"), self.redis.shard):
                return None
            await conn.execute(sql("lock_ledger_exclusive"), self.redis.shard)
            if not force and await self.redis.is_loaded():
                return False
            await self._replace(conn)
        return True

    async def _replace(self, conn: asyncpg.Connection) -> None:
        """Write Postgres's ledger to Redis (this shard's part of it); the caller holds the
        shard's ledger lock exclusively.

        Redis's ledger sequence restarts at the highest Postgres committed, so every later
        reservation is numbered above it and a Redis restored to an older state is caught (see
        reserve.lua). Only reservations advance it; settlements are the reconciler's to guard.
        """
        ledger = self.redis
        ledgers, runs = await _postgres_state(conn, ledger)
        held = await concurrency_state(conn, ledger, now=datetime.now(UTC))
        seq = ledger.shards.start(ledger.shard, await committed_seq(conn, ledger))
        sizes = {r["lease_key"]: r["size"] for r in await conn.fetch(sql("escrow_sizes")) if ledger.owns_key(r["lease_key"])}
        await rewrite.replace_all(
            ledger, ledgers=ledgers, runs=runs, generation=uuid.uuid4().hex, seq=seq, sizes=sizes,
            extra=lambda pipe: write_concurrency(pipe, ledger.keys, held), holding=lambda: conn.execute(sql("lock_ledger_exclusive"), ledger.shard),
        )  # fmt: skip
        self.rebuilds += 1
        shard = f" (shard {ledger.shard} of {ledger.shards.count})" if ledger.shards.count > 1 else ""
        log.warning("rebuilt the Redis ledger%s from Postgres (%d ledger keys, %d runs holding reservations)", shard, len(ledgers), len(runs))

    async def check_drift(self, *, repair: bool) -> Drift | None:
        """Compare Redis with Postgres a page at a time (budgetgate.ledger.drift); None when Redis
        is not loaded. With `repair`, confirmed differences are repaired."""
        return await drift.check(self.pool, self.redis, repair=repair, rebuild=self._replace)

    async def sweep_orphans(self, *, grace: timedelta, now: datetime) -> list[str]:
        """Release Redis holds older than `grace` whose decision never reached Postgres (the
        process died between reserving and committing). Returns the run ids released."""
        cutoff_ms = int((now - grace).timestamp() * 1000)
        released = []
        for run_id, (decision_id, at_ms) in (await self.redis.held_runs()).items():
            if at_ms > cutoff_ms or not decision_id:
                # Never released as "any decision's": a hold read while a rebuild rewrote it
                # could be a committed run's, settled later by the reconciler (twice released).
                continue
            async with self.pool.acquire() as conn, conn.transaction():
                # The run's lock: a retry of this run deciding right now finishes first.
                await conn.execute(sql("lock_ledger_shared"), self.redis.shard)
                await conn.execute(sql("lock_run"), run_id)
                known = await conn.fetchval("SELECT 1 FROM decision_keys WHERE decision_id = $1", _uuid(decision_id))
                if known:
                    continue
                if await self.redis.release(run_id, decision_id=decision_id):
                    log.warning("released orphaned reservation of run %r (decision %s never committed)", run_id, decision_id)
                    released.append(run_id)
        return released


async def _postgres_state(conn: asyncpg.Connection, ledger: RedisLedger) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[str, int, dict[str, int]]]]:
    """Every ledger key's (reserved, consumed), and every run's held amounts, from Postgres: of
    the keys on `ledger`'s shard."""
    ledgers = {r["ledger_key"]: (r["reserved"], r["consumed"]) for r in await conn.fetch(sql("all_ledger_figures")) if ledger.owns_key(r["ledger_key"])}
    runs: dict[str, tuple[str, int, dict[str, int]]] = {}
    amounts: dict[str, dict[str, int]] = defaultdict(dict)
    for row in await conn.fetch(sql("held_reservations")):
        if not ledger.owns_key(row["ledger_key"]):
            continue
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
