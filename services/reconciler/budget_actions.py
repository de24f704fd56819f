"""Budget-level consequences of consumption: threshold alerts, holds (and drains) when a budget
is exhausted and their lifting, and usage ageing out of rolling windows.

Threshold alerts are sent on both measures of core/thresholds.py, once per window each: on
consumed as a settlement moves it (`after_consumption`), on committed (reserved + consumed) at
the reconciler's next tick after admission reserved past a threshold (`committed_alerts`), so
the action feed says what `budgetgate budgets` and the gauges say, within a tick.

A budget is exhausted when what its window has consumed reaches its limit (reservations alone
never exhaust a budget: they are what running workloads are expected to use). Admission already
answers DELAY for a `hold` or `hold-and-drain` budget without room; the reconciler announces
the hold, asks the platform to drain the budget's running workloads under `hold-and-drain`, and
announces the release when the window rolls on, the limit is raised, or usage ages out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from budgetgate.core.policy import OnExhausted
from budgetgate.core.thresholds import THRESHOLDS, Measure, crossed
from budgetgate.ledger.queries import owned_by
from budgetgate.ledger.redis_ledger import LedgerKeyMissing, LedgerNotLoaded, RedisLedger
from budgetgate.services.reconciler import headroom, messages
from budgetgate.policies.policy_store import PolicyStore
from budgetgate.ledger.sharded import ShardedLedger
from budgetgate.ledger.transaction import ledger_transaction
from budgetgate.v1 import actions_pb2

sql = owned_by("budgetgate.services.reconciler")

log = logging.getLogger(__name__)

HOLDING = (OnExhausted.HOLD, OnExhausted.HOLD_AND_DRAIN)


def age_cutoff(rolling_days: int, now: datetime) -> datetime:
    """The first hour bucket still inside a rolling window of `rolling_days` ending now."""
    return now.astimezone(UTC).replace(minute=0, second=0, microsecond=0) - timedelta(days=rolling_days)


async def after_consumption(conn: asyncpg.Connection, rows: Sequence[Any], *, bundles: PolicyStore, now: datetime) -> None:
    """Alerts and holds for ledger keys whose consumption just changed (rows of add_consumed)."""
    for row in rows:
        key, limit, consumed = row["ledger_key"], row["limit_amount"], row["consumed"]
        if limit <= 0:
            continue
        for threshold in crossed(consumed, limit):
            if await conn.fetchval(sql("insert_alert"), key, str(Measure.CONSUMED), threshold):
                await _alert(conn, row, Measure.CONSUMED, threshold, amount=consumed, now=now)
        policy = bundles.active_policy(row["policy_id"])
        current = row["window_end"] is None or row["window_end"] > now
        if policy is None or policy.on_exhausted not in HOLDING or consumed < limit or not current:
            continue
        if await conn.fetchval(sql("insert_hold"), key, policy.id, row["scope_id"], str(policy.on_exhausted)):
            await messages.action(
                conn, kind=actions_pb2.HOLD, ledger_key=key, policy_id=policy.id, scope_id=row["scope_id"], now=now,
                text=f"budget {policy.id!r} is exhausted: new submissions in scope {row['scope_id']} are delayed; running workloads "
                + ("are asked to drain" if policy.on_exhausted is OnExhausted.HOLD_AND_DRAIN else "continue"),
            )  # fmt: skip
            if policy.on_exhausted is OnExhausted.HOLD_AND_DRAIN:
                for run in await conn.fetch(sql("running_under_policy"), policy.id):
                    await messages.action(
                        conn, kind=actions_pb2.DRAIN, ledger_key=key, policy_id=policy.id, scope_id=row["scope_id"], run_id=run["run_id"], now=now,
                        text=f"drain run {run['run_id']!r}: budget {policy.id!r} is exhausted",
                    )  # fmt: skip


async def committed_alerts(pool: asyncpg.Pool, *, now: datetime) -> int:
    """THRESHOLD_ALERT on committed for every current budget whose reserved + consumed reached a
    threshold since the last look; returns how many were sent. The alert row and its action
    commit together, and the row's key sends each alert once, whichever reconciler sees it."""
    sent = 0
    async with pool.acquire() as conn:
        for row in await conn.fetch(sql("committed_alerts_due"), list(THRESHOLDS), now):
            async with conn.transaction():
                if await conn.fetchval(sql("insert_alert"), row["ledger_key"], str(Measure.COMMITTED), row["threshold"]):
                    await _alert(conn, row, Measure.COMMITTED, row["threshold"], amount=row["committed"], now=now)
                    sent += 1
    return sent


async def _alert(conn: asyncpg.Connection, row: Any, measure: Measure, threshold: int, *, amount: int, now: datetime) -> None:
    what = "committed (reserved + consumed)" if measure is Measure.COMMITTED else "consumed"
    await messages.action(
        conn, kind=actions_pb2.THRESHOLD_ALERT, ledger_key=row["ledger_key"], policy_id=row["policy_id"], scope_id=row["scope_id"],
        threshold=threshold, measure=str(measure), now=now,
        text=f"budget {row['policy_id']!r} has {what} {100 * amount / row['limit_amount']:.1f}% of its limit in this window ({measure} {threshold}%)",
    )  # fmt: skip


async def lift_holds(pool: asyncpg.Pool, *, bundles: PolicyStore, now: datetime) -> list[str]:
    """Release holds whose window rolled on, whose limit was raised above what was consumed, or
    whose policy no longer holds; returns the ledger keys released. Each is judged locked with
    its ledger entry, so two reconcilers never both announce one release, and a settlement in
    flight (which may exhaust the budget again) is waited for by the next tick, not raced."""
    lifted = []
    async with pool.acquire() as conn, conn.transaction():
        for hold in await conn.fetch(sql("lock_active_holds")):
            policy = bundles.active_policy(hold["policy_id"])
            rolled = hold["window_end"] is not None and hold["window_end"] <= now
            raised = hold["consumed"] < hold["limit_amount"]
            if not (rolled or raised or policy is None or policy.on_exhausted not in HOLDING):
                continue
            if await conn.fetchrow(sql("lift_hold"), hold["ledger_key"]) is None:
                continue  # gone since it was read: whoever removed it announces it
            why = "its window has ended" if rolled else "it has room again" if raised else "its policy no longer holds"
            await messages.action(
                conn, kind=actions_pb2.RELEASE_HOLD, ledger_key=hold["ledger_key"], policy_id=hold["policy_id"], scope_id=hold["scope_id"], now=now,
                text=f"hold on budget {hold['policy_id']!r} lifted: {why}",
            )  # fmt: skip
            lifted.append(hold["ledger_key"])
    return lifted


async def age_rolling(pool: asyncpg.Pool, ledgers: ShardedLedger, *, now: datetime, bundles: PolicyStore | None = None) -> dict[str, int]:
    """Take usage that has left each rolling window out of its consumed (Postgres and Redis),
    and judge the runs waiting for room on it (with `bundles`); returns how much aged out per
    ledger key."""
    aged = {}
    for row in await pool.fetch(sql("rolling_keys")):
        cutoff = age_cutoff(row["rolling_days"], now)
        if cutoff <= row["aged_through"]:
            continue
        ledger = ledgers.of_key(row["ledger_key"])
        try:
            amount = await _age_key(pool, ledger, row["ledger_key"], cutoff, bundles=bundles, now=now)
        except LedgerKeyMissing:
            # Never loaded since the last rebuild: load Postgres's figure, age on the next tick.
            figures = await pool.fetchrow(sql("entry_figures"), row["ledger_key"])
            if figures is not None:
                await ledger.load_key(row["ledger_key"], reserved=figures["reserved"], consumed=figures["consumed"], size=figures["size"])
            continue
        except LedgerNotLoaded as exc:
            log.info("ageing %s waits for the Redis ledger to be rebuilt: %s", row["ledger_key"], exc)
            continue
        if amount:
            aged[row["ledger_key"]] = amount
    return aged


async def _age_key(pool: asyncpg.Pool, ledger: RedisLedger, key: str, cutoff: datetime, *, bundles: PolicyStore | None, now: datetime) -> int:
    async with ledger_transaction(pool, ledger) as work:
        conn = work.conn
        locked = await conn.fetchrow(sql("lock_rolling_age"), key)
        if locked is None or cutoff <= locked["aged_through"]:
            return 0
        amount = await conn.fetchval(sql("charges_between"), key, locked["aged_through"], cutoff)
        if amount:
            [row] = await conn.fetch(sql("add_consumed"), [key], [-amount])
            await conn.execute(sql("rearm_alerts"), key, row["consumed"], row["limit_amount"])
        await conn.execute(sql("set_aged_through"), key, cutoff)
        if amount > 0 and bundles is not None:
            cause = f"aged:{key}:{cutoff.isoformat()}"
            await headroom.after_release(conn, bundles=bundles, tenant=None, sensitive=False, policy_ids=[row["policy_id"]], cause=cause, now=now)
        if amount:
            # Last, right before the commit: Redis gives the room back only once Postgres has
            # everything else of it. Marked changed before the call: a script that ran but whose
            # reply was lost must invalidate Redis too, or the next tick ages the key again.
            work.changing(ledger)
            try:
                await ledger.consume({key: -amount})
            except (LedgerKeyMissing, LedgerNotLoaded):
                # Answered, and nothing changed (consume.lua checks every key first): no cause to
                # invalidate Redis, which made loading the missing key fail on a ledger being
                # rebuilt, and aborted the upkeep tick with it.
                work.unchanged(ledger)
                raise
        return amount
