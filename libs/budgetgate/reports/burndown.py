"""A budget's burn-down across its current window: what it has consumed day by day (metered
usage of the runs that reserved on it, reports/queries.sql `budget_daily_usage`), what it holds
reserved, and where the consumption so far leads by the window's end at the same pace. The page
for tenants and finance draws it (services/admission/routes/ui.py).

The projection is linear in the ledger's integers: consumed × window length ÷ time elapsed,
rounded half up, never less than what is consumed. The daily curve is kept for GPU-hour and
node-hour budgets, the units usage records carry; a budget in wall-hours or money has its
ledger figures and projection but no daily curve (`daily` is None)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from budgetgate.core.units import Unit, display
from budgetgate.core.windows import rfc3339
from budgetgate.ledger.queries import owned_by
from budgetgate.reports.budgets import Reading

sql = owned_by("budgetgate.reports")

# The units whose daily consumption usage records give, and the column that gives it.
DAILY_COLUMN = {Unit.GPU_HOURS: "gpu", Unit.NODE_HOURS: "node"}


def _micros(span: timedelta) -> int:
    return (span.days * 86_400 + span.seconds) * 1_000_000 + span.microseconds


def projected(consumed: int, *, start: datetime, end: datetime, now: datetime) -> int:
    """What `consumed` (by `now`) becomes by `end` at the same pace since `start`, in the same
    integer unit: consumed × (end − start) ÷ (now − start), half up. At or before the start
    nothing has elapsed to take a pace from (the consumed figure stands); at or after the end it
    is what was consumed."""
    if consumed < 0:
        raise ValueError(f"consumed must not be negative, not {consumed}")
    if end <= start:
        raise ValueError(f"a window ends after it starts ({rfc3339(start)} .. {rfc3339(end)})")
    elapsed, length = _micros(min(now, end) - start), _micros(end - start)
    if elapsed <= 0:
        return consumed
    return (2 * consumed * length + elapsed) // (2 * elapsed)


def exhausted_at(consumed: int, limit: int, *, start: datetime, end: datetime, now: datetime) -> datetime | None:
    """When consumption at the pace so far reaches `limit`, if before `end` (None otherwise, and
    when nothing is consumed yet); `now` itself when it already has."""
    if consumed >= limit:
        return min(now, end)
    elapsed = _micros(min(now, end) - start)
    if consumed <= 0 or elapsed <= 0:
        return None
    offset = -(-limit * elapsed // consumed)  # rounded up: never earlier than the pace says
    # Compared before it becomes an instant: a slow pace can lie past any date Python holds.
    return start + timedelta(microseconds=offset) if offset < _micros(end - start) else None


def cumulative(days: Sequence[tuple[datetime, int]]) -> list[tuple[datetime, int]]:
    """Each day with what was consumed up to its end, in day order."""
    total, out = 0, []
    for day, amount in sorted(days):
        total += amount
        out.append((day, total))
    return out


@dataclass(frozen=True)
class BurnDown:
    policy_id: str
    unit: Unit
    start: datetime
    end: datetime
    now: datetime
    limit: int
    consumed: int
    reserved: int
    # Each UTC day of the window so far with what was consumed up to its end (None: the unit has no daily figures).
    daily: list[tuple[datetime, int]] | None

    @property
    def projected(self) -> int:
        return projected(self.consumed, start=self.start, end=self.end, now=self.now)

    @property
    def exhausted_at(self) -> datetime | None:
        return exhausted_at(self.consumed, self.limit, start=self.start, end=self.end, now=self.now)

    def figures(self) -> dict[str, Any]:
        """The figures in the budget's unit, as a person reads them."""
        show = lambda amount: display(self.unit, amount)  # noqa: E731
        exhausted = self.exhausted_at
        return {
            "limit": show(self.limit),
            "consumed": show(self.consumed),
            "reserved": show(self.reserved),
            "projected": show(self.projected),
            "projected_with_reserved": show(self.projected + self.reserved),
            "exhausted_at": rfc3339(exhausted) if exhausted else None,
            "daily": [(rfc3339(day), show(total)) for day, total in self.daily] if self.daily is not None else None,
        }


async def burn_downs(conn: Any, budgets: Sequence[Reading], now: datetime) -> list[BurnDown]:
    """The burn-down of each budget read (reports/budgets.py `readings`), with the daily curves
    of them all read in one query."""
    daily = [b for b in budgets if b.policy.limit.unit in DAILY_COLUMN]
    by_key: dict[str, list[tuple[datetime, int, int]]] = {}
    if daily:
        keys = [b.ledger_key for b in daily]
        starts = [b.window.start for b in daily]
        ends = [max(b.window.start, min(b.window.end, now)) for b in daily]
        for row in await conn.fetch(sql("budget_daily_usage"), keys, starts, ends):
            by_key.setdefault(row["ledger_key"], []).append((row["day"], row["gpu"], row["node"]))
    found = []
    for b in budgets:
        unit = b.policy.limit.unit
        curve = None
        if unit in DAILY_COLUMN:
            column = 1 if DAILY_COLUMN[unit] == "gpu" else 2
            curve = cumulative([(row[0], row[column]) for row in by_key.get(b.ledger_key, [])])
        found.append(BurnDown(b.policy.id, unit, b.window.start, b.window.end, now, b.limit, b.consumed, b.reserved, curve))
    return found
