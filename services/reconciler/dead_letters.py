"""Settlements the reconciler dead-lettered: a run whose settlement kept failing for a reason
other than an outage (`REFUSALS`) is set aside in settlement_failures after `settle_tries`
tries, and is not tried again by itself. What it held stays held, so it is counted
(`budgetgate_reconciler_dead_lettered`), listed with what its run holds (`dead_letters`), and
resolved by an operator (`resolve`): its hold released, or its settlement made again once the
cause is fixed, in one ledger transaction with the admin log entry that says who did it and why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg
import redis.exceptions

from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.core.ledger_key import AmountOutOfRange
from budgetgate.core.units import Unit, display
from budgetgate.ledger.queries import owned_by
from budgetgate.services.reconciler.settler import STARTS_OVER, Outcome, Settler
from budgetgate.access.tokens import log_action

sql = owned_by("budgetgate.services.reconciler")

# Failures that say something about the run's data or the rules, not about an outage: retrying
# them cannot help, so they are dead-lettered after `settle_tries` (anything else, and anything
# in BACKEND_ERRORS first, is an outage and the loop retries it with backoff).
REFUSALS = (
    AmountOutOfRange,
    asyncpg.DataError,
    asyncpg.IntegrityConstraintViolationError,
    redis.exceptions.ResponseError,
    ValueError,
    LookupError,
    ArithmeticError,
    AssertionError,
    TypeError,
)

RELEASE, SETTLE = "settlement.release", "settlement.settle"  # their admin log actions


def failure_reason(exc: BaseException) -> str:
    """Why a settlement was refused, as settlement_failures keeps it."""
    return f"{type(exc).__name__}: {exc}"[:2000]


class NotDeadLettered(Exception):
    """The run has no dead-lettered settlement (unknown, or settled as usual): nothing to resolve."""

    def __init__(self, run_id: str, *, known: bool) -> None:
        self.run_id, self.known = run_id, known
        if known:
            text = f"run {run_id!r} has no dead-lettered settlement (the reconciler settles it as usual)"
        else:
            text = f"no run {run_id!r} is known (no admission was ever decided for it)"
        super().__init__(f"{text}; `budgetgate settlements dead-letters` lists those to resolve")


class StillFailing(Exception):
    """Settling the run again was refused as before: its cause is not fixed."""

    def __init__(self, run_id: str, reason: str) -> None:
        self.run_id, self.reason = run_id, reason
        super().__init__(f"run {run_id!r} still fails to settle ({reason})")


@dataclass(frozen=True)
class Resolution:
    """What resolving a dead-lettered settlement did: the action, and what the run held before
    and holds after (`holdings`)."""

    run_id: str
    action: str
    outcome: Outcome
    before: dict[str, Any]
    after: dict[str, Any]


async def count(conn: asyncpg.Connection | asyncpg.Pool) -> int:
    """How many settlements are dead-lettered now."""
    return int(await conn.fetchval(sql("dead_settlements_count")))


async def dead_letters(conn: asyncpg.Connection, *, limit: int = 1000) -> list[dict[str, Any]]:
    """The dead-lettered settlements, longest dead first: run, reason, tries, since when, and
    what the run holds (`holdings`)."""
    rows = await conn.fetch(sql("dead_settlements"), limit)
    held = await holdings(conn, [r["run_id"] for r in rows])
    return [{**_failure(r), **held[r["run_id"]]} for r in rows]


async def holdings(conn: asyncpg.Connection, run_ids: list[str]) -> dict[str, dict[str, Any]]:
    """What each run holds now: its reservations, each on a budget in that budget's unit (and
    raw, in the ledger's), its quota hold and its pool tokens."""
    found = {}
    for row in await conn.fetch(sql("runs_holding"), run_ids):
        reservations = json.loads(row["reservations"]) if isinstance(row["reservations"], str) else row["reservations"]
        found[row["run_id"]] = {
            "reservations": [{**r, "amount": display(Unit(r["unit"]), r["ledger_amount"])} for r in reservations],
            "quota": {"tenant": row["tenant"], "gpus": row["gpus"], "nodes": row["nodes"]} if row["gpus"] is not None else None,
            "pool_tokens": list(row["tokens"]),
        }
    return found


async def resolve(settler: Settler, run_id: str, *, release: bool, actor: str, reason: str, now: datetime | None = None) -> Resolution:
    """Resolve run `run_id`'s dead-lettered settlement: with `release`, give back what it holds
    (Settler.release_locked), else settle it again (Settler.settle_locked); in either case in
    one ledger transaction under the run's lock, which forgets the dead letter and logs the
    action with `actor` and `reason`. NotDeadLettered when there is none, StillFailing when the
    settlement is refused again: then nothing changed (Redis is rebuilt if the refused try had
    touched it, so that it still holds the ledger)."""
    action = RELEASE if release else SETTLE

    async def attempt() -> Resolution:
        at = now or datetime.now(UTC)
        async with settler.transaction(run_id) as work:
            conn = work.conn
            await settler.lock(work, run_id)
            dead = await conn.fetchrow(sql("dead_settlement"), run_id)
            if dead is None:
                raise NotDeadLettered(run_id, known=bool(await conn.fetchval(sql("run_has_decision"), run_id)))
            before = (await holdings(conn, [run_id]))[run_id]
            try:
                if release:
                    outcome = await settler.release_locked(work, run_id, at, why=f"released by an operator: {reason}")
                else:
                    outcome = await settler.settle_locked(work, run_id, at)
            except (*STARTS_OVER, *BACKEND_ERRORS):
                raise  # tried again (`retrying`), or an outage: neither says anything about the run
            except REFUSALS as exc:
                raise StillFailing(run_id, failure_reason(exc)) from exc
            await conn.execute(sql("forget_dead_settlement"), run_id)
            after = (await holdings(conn, [run_id]))[run_id]
            details = {
                "reason": reason,
                "failure": dead["reason"],
                "tries": dead["attempts"],
                "held": {r["ledger_key"]: r["ledger_amount"] for r in before["reservations"]},
                "quota": before["quota"],
                "pool_tokens": before["pool_tokens"],
            }
            await log_action(conn, actor=actor, action=action, subject=run_id, details=details)
            return Resolution(run_id, action, outcome, before, after)

    try:
        return await settler.retrying(run_id, attempt)
    except StillFailing:
        await settler.ensure_loaded()
        raise


def _failure(row: Any) -> dict[str, Any]:
    return {
        "run_id": row["run_id"],
        "reason": row["reason"],
        "tries": row["attempts"],
        "failing_since": row["first_failed_at"].isoformat(),
        "dead_since": row["last_failed_at"].isoformat(),
    }
