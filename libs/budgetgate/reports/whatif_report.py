"""The what-if report: the period's recorded submissions decided again under a candidate policy
bundle on a simulated ledger (budgetgate.core.whatif), with what would flip, the decisions not
simulated (decided by what the simulation does not model, such as a tenant quota: never flips)
and each budget's admitted GPU-hours and cost before and after; nothing live changes.
`budgetgate policy what-if` prints it and the what-if benchmark times it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from datetime import datetime
from typing import Any

from budgetgate.core.policy import PolicyBundle
from budgetgate.core.units import hours, money
from budgetgate.core.whatif import Outcome, simulate
from budgetgate.core.windows import rfc3339
from budgetgate.ledger.archive import archives_within
from budgetgate.ledger.queries import owned_by
from budgetgate.reports.history import recorded_history

sql = owned_by("budgetgate.reports")


async def decisions_since(conn: Any, start: datetime) -> int:
    """How many decisions were recorded from `start` on: a what-if reads each, then decides it
    again, so its progress counts to twice this."""
    return await conn.fetchval(sql("whatif_decision_count"), start)


async def what_if(conn: Any, candidate: PolicyBundle, start: datetime, *, progress: Callable[[int], None] | None = None) -> dict[str, Any]:
    """The what-if report of `candidate` over the decisions recorded since `start`; `progress`
    is told how many decisions were read, then decided again, as it goes. Months of the period
    that are archived are named (`archived`, only when there are any): their decisions are not
    in Postgres to decide again."""
    history = await recorded_history(conn, start, progress=progress)
    outcome = simulate(candidate, start=history.start, decisions=history.decisions, ends=history.ends, holds=history.holds, progress=progress)
    report = as_report(outcome, start)
    archived = await archives_within(conn, "decisions", start)
    if archived:
        report["archived"] = archived
    return report


def as_report(outcome: Outcome, start: datetime) -> dict[str, Any]:
    """The simulation's outcome as the report (`budgetgate policy what-if --json` prints it)."""
    budgets = []
    for b in outcome.by_budget.values():
        cost = b.cost_before or b.cost_after
        budgets.append({
            "policy_id": b.policy_id, "scope_id": b.scope_id, "unit": b.unit,
            "admitted_gpu_hours_before": hours(b.admitted_gpu_before), "admitted_gpu_hours_after": hours(b.admitted_gpu_after),
            "admitted_gpu_hours_change": hours(b.admitted_gpu_after - b.admitted_gpu_before),
            "showback_cost_before": float(money(b.cost_before)) if cost else None, "showback_cost_after": float(money(b.cost_after)) if cost else None,
            "showback_cost_change": float(money(b.cost_after - b.cost_before)) if cost else None, "currency": b.currency,
            "exhausted_at": rfc3339(b.exhausted_at) if b.exhausted_at else None,
        })  # fmt: skip
    return {
        "since": rfc3339(start),
        "decisions": outcome.decisions,
        "flips": [
            {"run_id": f.run_id, "attempt": f.attempt, "decided_at": rfc3339(f.at), "before": f.before, "after": f.after, "reason": f.reason}
            for f in outcome.flips
        ],
        "not_simulated": [
            {
                "run_id": n.run_id,
                "attempt": n.attempt,
                "decided_at": rfc3339(n.at),
                "outcome": n.outcome,
                "decided_by": n.decided_by,
                "reason": n.reason,
                "budgets_after": n.budgets_after,
            }
            for n in outcome.not_simulated
        ],  # fmt: skip
        "not_simulated_by": dict(sorted(Counter(n.decided_by for n in outcome.not_simulated).items())),
        "by_budget": budgets,
        "unplannable": outcome.unplannable,
    }
