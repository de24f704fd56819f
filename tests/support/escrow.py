"""Escrow leases in tests: a budget shared by roots on real Postgres and Redis, a decision of a
root reserving on its lease alone (as admission will), and each lease's size in both."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import asyncpg

from budgetgate.core import escrow as arithmetic
from budgetgate.ledger.escrow_leases import Escrow
from budgetgate.ledger.queries import sql
from budgetgate.ledger.redis_ledger import ChargeRequest, RedisLedger, Reservation, ReserveResult
from budgetgate.ledger.redis_sync import LedgerSync
from budgetgate.ledger.transaction import committed_seq

BUDGET = "cost-center=ml|2026-11-01T00:00:00Z/2026-12-01T00:00:00Z|gpu_hours"
NOW_MS = 1_796_000_000_000


@dataclass
class Setup:
    pool: asyncpg.Pool
    ledger: RedisLedger
    escrow: Escrow
    sync: LedgerSync


async def shared_budget(pool: asyncpg.Pool, ledger: RedisLedger, *, limit: int) -> Setup:
    """BUDGET's ledger entry with `limit`, Redis rebuilt from Postgres, and its escrow."""
    await pool.execute(
        "INSERT INTO ledger_entries (ledger_key, scope_id, unit, window_key, window_start, window_end, policy_id, policy_git_sha, limit_amount)"
        " VALUES ($1, 'cost-center=ml', 'gpu_hours', '2026-11-01T00:00:00Z/2026-12-01T00:00:00Z', '2026-11-01', '2026-12-01', 'ml', $2, $3)",
        BUDGET, "a" * 40, limit,
    )  # fmt: skip
    sync = LedgerSync(pool, ledger)
    await sync.rebuild(force=True)
    return Setup(pool, ledger, Escrow(pool, lambda _root: ledger), sync)


async def reserve(s: Setup, root: str, amount: int, run_id: str | None = None) -> bool:
    """A decision of `root` reserving `amount` on its lease alone, as admission will; raises
    LedgerNotLoaded when Redis is not loaded or is behind what Postgres committed."""
    return (await reservation(s, root, amount, run_id)).status == "RESERVED"


async def reserve_with_refill(s: Setup, root: str, amount: int, *, chunk: int) -> tuple[bool, int]:
    """As `reserve`, with the one synchronous refill admission makes before it refuses
    (Escrow.refill): whether it was reserved, and what the refill granted."""
    result = await reservation(s, root, amount)
    if result.status != "REJECTED":
        return result.status == "RESERVED", 0
    granted = await s.escrow.refill(BUDGET, root, amount=amount, seen=arithmetic.Lease(result.sizes[0] or 0, *result.readings[0]), chunk=chunk)
    return granted > 0 and await reserve(s, root, amount), granted


async def reservation(s: Setup, root: str, amount: int, run_id: str | None = None) -> ReserveResult:
    """What `reserve` asks of Redis, as it answered."""
    lease = arithmetic.lease_key(BUDGET, root)
    committed = await committed_seq(s.pool, s.ledger)
    asked = Reservation(run_id or f"run-{uuid.uuid4().hex[:8]}", str(uuid.uuid4()), (ChargeRequest(lease, amount, 0, True, lease=True),))
    for _ in range(2):
        [result] = await s.ledger.reserve_batch([asked], now_ms=NOW_MS, committed_seq=committed)
        if result.status != "MISSING":
            return result
        await s.escrow.open(BUDGET, root)  # a root's first decision on the budget opens its lease, of size 0
        row = await s.pool.fetchrow(sql("ledger_figures"), [lease])  # as admission loads a key it never had
        await s.ledger.load_key(lease, reserved=row["reserved"], consumed=row["consumed"], size=row["size"])
    raise AssertionError("the lease's key stayed missing")


async def sizes(s: Setup) -> tuple[dict[str, int], dict[str, int]]:
    """Each root's lease size in Postgres and in Redis."""
    postgres = {row["root"]: row["size"] for row in await s.pool.fetch("SELECT root, size FROM escrow_leases WHERE ledger_key = $1", BUDGET)}
    redis = await s.ledger.sizes([arithmetic.lease_key(BUDGET, root) for root in postgres])
    return postgres, {root: redis.get(arithmetic.lease_key(BUDGET, root), 0) for root in postgres}
