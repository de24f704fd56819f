"""Every budget of a bundle in its current window, in human units, from the ledger's truth in
Postgres: `GET /v1/budgets`, the budget gauges and `budgetgate budgets`. "Committed" and
"consumed" are the two measures of core/thresholds.py, the ones the alerts use. A window's limit
is the policy's plus its grants (core/grants.py), shown apart and listed."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from budgetgate.core.evaluation import ledger_key
from budgetgate.core.grants import grants_view
from budgetgate.core.policy import BudgetPolicy, PolicyBundle
from budgetgate.core.thresholds import budget_state, crossed, ratio
from budgetgate.core.units import display
from budgetgate.core.windows import Window, rfc3339, window_at
from budgetgate.ledger.queries import owned_by

sql = owned_by("budgetgate.reports")


@dataclass(frozen=True)
class Reading:
    """A budget in its current window, in the ledger's integers."""

    policy: BudgetPolicy
    window: Window
    ledger_key: str
    limit: int  # the policy's plus the window's grants
    reserved: int
    consumed: int
    held: bool


async def readings(conn: Any, bundle: PolicyBundle, now: datetime) -> list[Reading]:
    """Each budget of `bundle` in the window containing `now`, in one query."""
    # Most budgets share a few window specs (month in UTC, ...): lay each out once.
    laid_out = {spec: window_at(spec, now) for spec in {p.window for p in bundle.policies}}
    windows = [laid_out[p.window] for p in bundle.policies]
    keys = [ledger_key(p, w) for p, w in zip(bundle.policies, windows, strict=True)]
    rows = {r["ledger_key"]: r for r in await conn.fetch(sql("budget_figures"), keys)} if keys else {}
    found = []
    for policy, window, key in zip(bundle.policies, windows, keys, strict=True):
        row = rows.get(key)
        reserved, consumed, held = (row["reserved"], row["consumed"], row["held"]) if row else (0, 0, False)
        found.append(Reading(policy, window, key, bundle.limit_of(policy, key), reserved, consumed, held))
    return found


async def list_budgets(conn: Any, bundle: PolicyBundle, now: datetime) -> list[dict[str, Any]]:
    """Each budget of `bundle` in the window containing `now`, in human units, in one query."""
    budgets = []
    for reading in await readings(conn, bundle, now):
        policy, window, key, reserved, consumed, held = reading.policy, reading.window, reading.ledger_key, reading.reserved, reading.consumed, reading.held
        unit, limit = policy.limit.unit, reading.limit
        committed = reserved + consumed
        remaining = limit - committed
        committed_ratio, consumed_ratio = ratio(committed, limit), ratio(consumed, limit)
        budgets.append({
            "policy_id": policy.id,
            "scope_id": policy.scope.scope_id,
            "window_key": window.key,
            "window_start": rfc3339(window.start),
            "window_end": rfc3339(window.end),
            "unit": str(unit),
            "currency": policy.limit.currency,
            "enforcement": str(policy.enforcement),
            "limit": display(unit, limit),
            **grants_view(bundle, policy, key),
            "reserved": display(unit, reserved),
            "consumed": display(unit, consumed),
            "remaining": display(unit, remaining),
            "committed": display(unit, committed),
            "committed_percent": round(100 * committed_ratio, 1),
            "committed_ratio": round(committed_ratio, 6),
            "consumed_percent": round(100 * consumed_ratio, 1),
            "consumed_ratio": round(consumed_ratio, 6),
            "alerts": [f"committed {t}%" for t in crossed(committed, limit)] + [f"consumed {t}%" for t in crossed(consumed, limit)],
            # Kept for readers of the first release: the committed measure under its old name.
            "used_percent": round(100 * committed_ratio, 1),
            "used_ratio": round(committed_ratio, 6),
            "state": budget_state(reserved=reserved, consumed=consumed, limit=limit, held=held),
        })  # fmt: skip
    return budgets
