"""Each tenant's GPU usage decayed with the fair-share half-life (core/decay.py), kept as runs are
settled: one row per tenant, locked and moved by what a settlement changed of a run's actual
GPU usage, at a cost independent of the tenant's history. Admission reads the rows for the
decayed share of its answers."""

from __future__ import annotations

from datetime import datetime, timedelta

import asyncpg

from budgetgate.core.decay import Decayed
from budgetgate.ledger.queries import owned_by

sql = owned_by("budgetgate.services.reconciler")


async def add_usage(conn: asyncpg.Connection, *, tenant: str, amount: int, at: datetime, half_life: timedelta) -> Decayed:
    """Count `amount` milli-GPU-hours used by `tenant` at `at` (negative: a provisional charge
    corrected down), in `conn`'s transaction; returns the tenant's figure after it."""
    row = await conn.fetchrow(sql("lock_fair_share_usage"), tenant, at, half_life.total_seconds())
    figure = Decayed(row["decayed_gpu"], row["reckoned_at"], timedelta(seconds=row["half_life_seconds"]))
    figure = figure.with_half_life(half_life, figure.reckoned).add(amount, at)
    await conn.execute(sql("put_fair_share_usage"), tenant, figure.amount, figure.reckoned, half_life.total_seconds())
    return figure
