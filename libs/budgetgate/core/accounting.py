"""An external accounting system's word on a tenant's soft GPU-hour budget.

When an accounting system (Waldur-style `remaining_budget`) answers in time, its figure is the
room left in the tenant's soft GPU-hour budget, in place of the ledger's limit − reserved −
consumed; otherwise the ledger's own figure stands. Either way the decision records which one
it used, so it can be recomputed and explained.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from budgetgate.core.evaluation import Plan, Reading
from budgetgate.core.units import hours

EXTERNAL, LEDGER = "external", "ledger"


@dataclass(frozen=True, slots=True)
class BudgetSource:
    """Which figure a tenant's soft GPU-hour budget (policy `policy_id`) was judged on:
    `external` with its `remaining` (ledger units), or `ledger` with `detail` saying why."""

    policy_id: str
    source: Literal["external", "ledger"]
    remaining: int | None = None
    detail: str = ""

    def body(self) -> dict[str, Any]:
        """As the answer shows it (`accounting`)."""
        return {
            "policy_id": self.policy_id,
            "source": self.source,
            "remaining_gpu_hours": hours(self.remaining) if self.remaining is not None else None,
            "detail": self.detail,
        }

    def record(self) -> dict[str, Any]:
        """As decisions.readings keeps it."""
        return {"policy_id": self.policy_id, "source": self.source, "remaining": self.remaining, "detail": self.detail}

    @classmethod
    def recorded(cls, stored: Mapping[str, Any] | None) -> BudgetSource | None:
        if not stored:
            return None
        return cls(stored["policy_id"], stored["source"], stored.get("remaining"), stored.get("detail", ""))


def with_external(plan: Plan, readings: Mapping[str, Reading] | None, source: BudgetSource | None) -> Mapping[str, Reading] | None:
    """`readings` with the external figure standing for the budget's room: the reading keeps
    its limit and is given as used whatever the figure leaves (limit − remaining), so
    remaining, utilization and the penalty follow from the accounting system's figure."""
    if readings is None or source is None or source.source != EXTERNAL or source.remaining is None:
        return readings
    changed = dict(readings)
    for charge in plan.charges:
        if charge.policy.id == source.policy_id and charge.ledger_key in changed:
            limit = changed[charge.ledger_key].limit
            changed[charge.ledger_key] = Reading(limit, limit - source.remaining, 0)
    return changed
