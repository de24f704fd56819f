"""Every budget of a bundle in its current window, in human units, from the ledger's truth in
Postgres: `GET /v1/budgets`, the budget gauges and `budgetgate budgets`."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from budgetgate.core.evaluation import ledger_key
from budgetgate.core.policy import PolicyBundle
from budgetgate.core.units import display
from budgetgate.core.windows import rfc3339, window_at
from budgetgate.ledger.queries import owned_by

sql = owned_by("budgetgate.reports")

# The share of a budget used from which it is "alerting" (the reconciler alerts at 80 % too).
ALERT_RATIO = 0.8


def budget_state(*, used_ratio: float, remaining: int, held: bool) -> str:
    """ok / alerting / exhausted / held: a hold wins, then no room left, then 80 % used."""
    if held:
        return "held"
    if remaining <= 0:
        return "exhausted"
    return "alerting" if used_ratio >= ALERT_RATIO else "ok"


async def list_budgets(conn: Any, bundle: PolicyBundle, now: datetime) -> list[dict[str, Any]]:
    """Each budget of `bundle` in the window containing `now`, in human units, in one query."""
    # Most budgets share a few window specs (month in UTC, ...): lay each out once.
    laid_out = {spec: window_at(spec, now) for spec in {p.window for p in bundle.policies}}
    windows = [laid_out[p.window] for p in bundle.policies]
    keys = [ledger_key(p, w) for p, w in zip(bundle.policies, windows, strict=True)]
    rows = {r["ledger_key"]: r for r in await conn.fetch(sql("budget_figures"), keys)} if keys else {}
    budgets = []
    for policy, window, key in zip(bundle.policies, windows, keys, strict=True):
        row = rows.get(key)
        reserved, consumed, held = (row["reserved"], row["consumed"], row["held"]) if row else (0, 0, False)
        unit, limit = policy.limit.unit, policy.limit.amount
        remaining = limit - reserved - consumed
        ratio = (reserved + consumed) / limit if limit else 0.0
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
            "reserved": display(unit, reserved),
            "consumed": display(unit, consumed),
            "remaining": display(unit, remaining),
            "used_percent": round(100 * ratio, 1),
            "used_ratio": round(ratio, 6),
            "state": budget_state(used_ratio=ratio, remaining=remaining, held=held),
        })  # fmt: skip
    return budgets
