"""Budget status of a scope in its current window, and usage by the value of a label (a tenant,
a user), from Postgres (the ledger's truth): the usage routes of admission and `budgetgate usage`."""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import Any

import asyncpg

from budgetgate.core.evaluation import ledger_key
from budgetgate.core.grants import grants_view
from budgetgate.core.policy import PolicyBundle
from budgetgate.core.units import display, hours
from budgetgate.core.windows import rfc3339, window_at
from budgetgate.ledger.queries import owned_by
from budgetgate.runtime.settings import CommonSettings

sql = owned_by("budgetgate.reports")


class UserSettings(CommonSettings):
    # The label whose value names the user a run was submitted for.
    user_label: str = "user"


async def scope_usage(pool: asyncpg.Pool, bundle: PolicyBundle, scope_id: str, now: datetime) -> dict[str, Any] | None:
    """Limit (the policy's plus the window's grants, listed), reserved, consumed and remaining
    for every budget on `scope_id`; None if no policy of the bundle has that scope."""
    policies = [p for p in bundle.policies if p.scope.scope_id == scope_id]
    if not policies:
        return None
    windows = {p.id: window_at(p.window, now) for p in policies}
    keys = {p.id: ledger_key(p, windows[p.id]) for p in policies}
    rows = {r["ledger_key"]: r for r in await pool.fetch(sql("scope_figures"), list(keys.values()))}
    budgets = []
    for policy in policies:
        row = rows.get(keys[policy.id])
        reserved, consumed = (row["reserved"], row["consumed"]) if row else (0, 0)
        unit, limit = policy.limit.unit, bundle.limit_of(policy, keys[policy.id])
        remaining = limit - reserved - consumed
        budgets.append(
            {
                "policy_id": policy.id,
                "policy_git_sha": bundle.git_sha,
                "unit": str(unit),
                "currency": policy.limit.currency,
                "enforcement": str(policy.enforcement),
                "window_start": rfc3339(windows[policy.id].start),
                "window_end": rfc3339(windows[policy.id].end),
                "limit": display(unit, limit),
                **grants_view(bundle, policy, keys[policy.id]),
                "reserved": display(unit, reserved),
                "consumed": display(unit, consumed),
                "remaining": display(unit, remaining),
                "utilization": round((reserved + consumed) / limit, 6) if limit else None,
            }
        )
    return {"scope_id": scope_id, "budgets": budgets}


async def labelled_usage(pool: asyncpg.Pool, bundle: PolicyBundle | None, *, who: str, label: str, value: str, days: int, now: datetime) -> dict[str, Any]:
    """What the runs labelled `label`=`value` use: the budgets whose scope requires that label
    value, in their current windows, and the runs' reservations and metered usage since `days`
    ago. Usage by tenant and usage by user are this one reading; `who` names the value's key."""
    since = now - timedelta(days=days)
    scopes = sorted({p.scope.scope_id for p in (bundle.policies if bundle else ()) if p.scope.labels.get(label) == value})
    budgets = []
    for scope_id in scopes:
        usage = await scope_usage(pool, bundle, scope_id, now) if bundle else None
        budgets += [{"scope_id": scope_id, **b} for b in (usage or {}).get("budgets", [])]
    runs = await pool.fetchrow(sql("labelled_runs"), label, value, since)
    return {
        who: value,
        "label": label,
        "days": days,
        "since": rfc3339(since),
        "policy_bundle_sha": bundle.git_sha if bundle else None,
        "budgets": budgets,
        "runs": {
            "runs": runs["runs"],
            "admitted": runs["admitted"],
            "reserved_gpu_hours": hours(runs["reserved_gpu"]),
            "consumed_gpu_hours": hours(runs["consumed_gpu"]),
            "consumed_node_hours": hours(runs["consumed_node"]),
        },
    }
