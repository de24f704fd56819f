"""One truth for "how used is a budget": two measures, named as such everywhere they appear
(`budgetgate budgets`, `GET /v1/budgets`, the Prometheus gauges and alert rules, the
THRESHOLD_ALERT actions on budget.actions.v1):

- **committed**: reserved + consumed, what the budget has promised in its window (running and
  admitted work at its projection, finished work at its actuals). At 100 % the budget is *full*:
  new work does not fit.
- **consumed**: actual usage only. At 100 % the budget is *exhausted*: a `hold` budget holds.

Each measure alerts once per window at each of `THRESHOLDS` percent.
"""

from __future__ import annotations

from enum import StrEnum

THRESHOLDS = (80, 100)


class Measure(StrEnum):
    COMMITTED = "committed"
    CONSUMED = "consumed"


def ratio(amount: int, limit: int) -> float:
    """`amount` as a share of `limit` (0 for a budget of no limit, which never alerts)."""
    return amount / limit if limit > 0 else 0.0


def crossed(amount: int, limit: int) -> list[int]:
    """The thresholds (percent) `amount` has reached of `limit`, exactly (integer arithmetic)."""
    if limit <= 0:
        return []
    return [t for t in THRESHOLDS if amount * 100 >= t * limit]


def budget_state(*, reserved: int, consumed: int, limit: int, held: bool) -> str:
    """held / exhausted / full / alerting / ok: a hold wins, then consumed at its limit, then
    nothing left to commit, then committed at the first of THRESHOLDS."""
    if held:
        return "held"
    if limit > 0 and consumed >= limit:
        return "exhausted"
    if reserved + consumed >= limit:
        return "full"
    return "alerting" if crossed(reserved + consumed, limit) else "ok"
