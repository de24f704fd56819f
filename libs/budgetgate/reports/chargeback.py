"""Chargeback: metered GPU-hours, node-hours and their cost in the rate card's currency over a
half-open period [from, to), grouped by account (rolled up the tree), tenant, user, budget,
flavor or region and by day, week or month, with what is reserved but not yet metered in columns of its own (`budgetgate report`,
`GET /v1/reports/chargeback`).

Postgres sums the ledger at one fixed grain (namespace, tenant, user, flavor, region, the budgets
a run reserved on, UTC day, rate segment; reports/queries.sql); each such row is priced once at
the rate in effect (the active bundle's rate cards), half up to a millionth of the currency, and
the report is rolled up from those rows. So every grouping and period adds up to the same
totals, in the ledger's own units (milli-unit-seconds, micro-currency).

By account, a run counts under its own account (the deepest one of the tree its namespace and
labels fall under, core/accounts.py) and under every account above it, so each account's row is
its whole subtree; as by budget, the total counts each run once."""

from __future__ import annotations

import csv
import io
import itertools
import json
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from typing import Any

import asyncpg

from budgetgate.core.policy import PolicyBundle
from budgetgate.core.units import cost_micros, hours, money
from budgetgate.core.windows import rfc3339
from budgetgate.ledger.archive import archives_within
from budgetgate.ledger.queries import owned_by

sql = owned_by("budgetgate.reports")

GROUP_KEYS = ("account", "tenant", "user", "budget", "flavor", "region")
PERIODS = ("day", "week", "month", "none")
FORMATS = ("json", "csv", "table")
# The figures of a row: the ledger's integers (exact), then as a person reads them.
AMOUNTS = ("gpu_milli_hours", "node_milli_hours", "cost_micros", "unpriced_gpu_milli_hours", "reserved_gpu_milli_hours", "reserved_cost_micros")
FIGURES = ("gpu_hours", "node_hours", "cost", "unpriced_gpu_hours", "reserved_gpu_hours", "reserved_cost")
WORK_MEM = "64MB"


class ReportError(ValueError):
    """Input a report cannot be made of; `field` names the parameter at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class ReportRequest:
    start: datetime
    end: datetime
    group_by: tuple[str, ...] = ("tenant",)
    period: str = "none"

    @classmethod
    def parse(cls, start: str, end: str, group_by: Iterable[str] = ("tenant",), period: str = "none") -> ReportRequest:
        """A request from its text, as typed or sent; raises ReportError naming the field."""
        first, last = instant(start, "from"), instant(end, "to")
        if first >= last:
            raise ReportError("to", f"'to' ({rfc3339(last)}) must be after 'from' ({rfc3339(first)}): the period is [from, to)")
        return cls(first, last, group_keys(group_by), period_of(period))


def instant(text: str, field: str) -> datetime:
    """An RFC 3339 instant (`2026-11-01T00:00:00Z`) or a date (`2026-11-01`, midnight UTC)."""
    value = text.strip()
    try:
        if len(value) == 10:
            return datetime.combine(date.fromisoformat(value), datetime.min.time(), tzinfo=UTC)
        at = datetime.fromisoformat(value)
    except ValueError:
        raise ReportError(field, f"{field} {text!r} is neither a date (2026-11-01) nor an RFC 3339 instant (2026-11-01T00:00:00Z)") from None
    if at.tzinfo is None:
        raise ReportError(field, f"{field} {text!r} needs a time zone, e.g. {value}Z")
    try:
        return at.astimezone(UTC)
    except OverflowError:
        raise ReportError(field, f"{field} {text!r} is out of range") from None


def group_keys(values: Iterable[str]) -> tuple[str, ...]:
    """Group keys from one or several values, each a key or keys joined by commas."""
    keys: list[str] = []
    for value in values:
        for key in (k.strip() for k in value.split(",")):
            if key not in GROUP_KEYS:
                raise ReportError("group_by", f"unknown group key {key!r}: one or several of {', '.join(GROUP_KEYS)}")
            if key not in keys:
                keys.append(key)
    return tuple(keys)


def period_of(value: str) -> str:
    if value not in PERIODS:
        raise ReportError("period", f"unknown period {value!r}: one of {', '.join(PERIODS)}")
    return value


def period_start(day: datetime, period: str) -> datetime | None:
    """The start of the period (UTC) a UTC day falls in; None without periods."""
    if period == "day":
        return day
    if period == "week":
        return day - timedelta(days=day.weekday())  # ISO weeks, from Monday
    if period == "month":
        return day.replace(day=1)
    return None


def breakpoints(bundle: PolicyBundle | None, start: datetime, end: datetime) -> list[datetime]:
    """Where a rate takes effect inside [start, end), ascending: within two of them every rate is the same."""
    found = {rate.effective_from for card in (bundle.rate_cards if bundle else ()) for rate in card.rates if rate.effective_from is not None}
    return sorted(at for at in found if start < at < end)


def currency(bundle: PolicyBundle | None) -> str | None:
    return bundle.rate_cards[0].currency if bundle and bundle.rate_cards else None


@asynccontextmanager
async def _acquired(pool: asyncpg.Pool | asyncpg.Connection) -> AsyncIterator[asyncpg.Connection]:
    if isinstance(pool, asyncpg.Connection):
        yield pool
    else:
        async with pool.acquire() as conn:
            yield conn


def _price(bundle: PolicyBundle | None, flavor: str | None, region: str | None, at: datetime, gpu: int) -> int | None:
    """Cost in micro-currency of `gpu` milli-GPU-hours at the rate in effect at `at`; None when none prices them."""
    priced = bundle.rate_for(flavor, region, at) if bundle and flavor else None
    return cost_micros(gpu, priced[0].rate_per_gpu_hour) if priced else None


async def chargeback(
    pool: asyncpg.Pool | asyncpg.Connection,
    bundle: PolicyBundle | None,
    request: ReportRequest,
    *,
    tenant_label: str,
    user_label: str,
    sees: Callable[[str, str | None], bool] | None = None,
) -> dict[str, Any]:
    """The report of `request`; `sees(namespace, tenant)` keeps the runs a limited reader may see."""
    breaks = breakpoints(bundle, request.start, request.end)
    by_account = "account" in request.group_by
    if by_account and (bundle is None or not bundle.accounts):
        raise ReportError("group_by", "grouping by account needs Account documents in the active policy bundle, and it has none (docs/policies.md#accounts)")
    args = (request.start, request.end, breaks, tenant_label, user_label, by_account)
    async with _acquired(pool) as conn, conn.transaction(readonly=True, isolation="repeatable_read"):
        gone = await archives_within(conn, "usage_records", request.start, request.end)
        if gone:  # a report missing months of usage would undercharge without saying so
            months = ", ".join(a["from"][:7] for a in gone)
            raise ReportError(
                "from", f"the usage of {months} is archived (`budgetgate ledger archive`): restore it (`budgetgate ledger restore`) to report on that period"
            )
        # One snapshot for both readings. The plan's aggregate needs more than the default
        # work_mem over a month of records (else it spills to disk), and compiling it with JIT
        # costs more than it saves (docs/benchmarks.md, `budgetgate bench report`).
        await conn.execute(f"SET LOCAL work_mem = '{WORK_MEM}'; SET LOCAL jit = off")
        metered = await conn.fetch(sql("chargeback_metered"), *args)
        reserved = await conn.fetch(sql("chargeback_reserved"), *args)
    cells: dict[tuple[Any, ...], list[int]] = {}
    total = [0] * len(AMOUNTS)

    def add(row: asyncpg.Record, amounts: Sequence[int]) -> None:
        if sees is not None and not sees(row["namespace"], row["tenant"]):
            return
        for i, amount in enumerate(amounts):
            total[i] += amount
        values = {"tenant": [row["tenant"]], "user": [row["user_value"]], "flavor": [row["flavor"]], "region": [row["region"]]}
        # A run that reserved on several budgets counts under each; one on none under no budget.
        # By account: under its own account and every account above it (none: under no account).
        values["budget"] = list(row["budgets"] or [None])
        if by_account:
            values["account"] = chain(row["namespace"], row["labels"])
        period = period_start(row["day"], request.period)
        for groups in itertools.product(*(values[k] for k in request.group_by)):
            cell = cells.setdefault((period, *groups), [0] * len(AMOUNTS))
            for i, amount in enumerate(amounts):
                cell[i] += amount

    chains: dict[tuple[str, str], list[str | None]] = {}

    def chain(namespace: str, labels: Any) -> list[str | None]:
        """The run's account and every account above it (asyncpg gives jsonb as its text)."""
        text = labels if isinstance(labels, str) else json.dumps(labels or {}, sort_keys=True)
        found = chains.get((namespace, text))
        if found is None:
            assert bundle is not None
            tree = bundle.accounts
            own = tree.account_of(namespace, json.loads(text))
            found = chains[namespace, text] = [own, *tree.ancestors(own)] if own is not None else [None]
        return found

    for row in metered:
        cost = _price(bundle, row["flavor"], row["region"], row["priced_at"], row["gpu"])
        add(row, (row["gpu"], row["node"], cost or 0, row["gpu"] if cost is None else 0, 0, 0))
    for row in reserved:
        cost = _price(bundle, row["flavor"], row["region"], row["priced_at"], row["gpu"])
        add(row, (0, 0, 0, 0, row["gpu"], cost or 0))
    order = sorted(cells, key=lambda k: tuple((v is None, v if v is not None else "") for v in k))
    rows = [_row(key, cells[key], request) for key in order]
    return {
        "from": rfc3339(request.start),
        "to": rfc3339(request.end),
        "group_by": list(request.group_by),
        "period": request.period,
        "currency": currency(bundle),
        "policy_bundle_sha": bundle.git_sha if bundle else None,
        "tenant_label": tenant_label,
        "user_label": user_label,
        "rows": rows,
        "total": _figures(total),
    }


def _row(key: tuple[Any, ...], amounts: Sequence[int], request: ReportRequest) -> dict[str, Any]:
    period, *groups = key
    head: dict[str, Any] = {"period_start": rfc3339(period) if period else None} if request.period != "none" else {}
    return {**head, **dict(zip(request.group_by, groups, strict=True)), **_figures(amounts)}


def _figures(amounts: Sequence[int]) -> dict[str, Any]:
    gpu, node, cost, unpriced, reserved_gpu, reserved_cost = amounts
    shown = {
        "gpu_hours": hours(gpu),
        "node_hours": hours(node),
        "cost": float(money(cost)),
        "unpriced_gpu_hours": hours(unpriced),
        "reserved_gpu_hours": hours(reserved_gpu),
        "reserved_cost": float(money(reserved_cost)),
    }
    return {**shown, **dict(zip(AMOUNTS, amounts, strict=True))}


def columns(report: dict[str, Any]) -> list[str]:
    """The columns of the report's rows, in order (CSV and JSON carry the same)."""
    head = ["period_start"] if report["period"] != "none" else []
    return [*head, *report["group_by"], *FIGURES, *AMOUNTS]


def as_csv(report: dict[str, Any]) -> str:
    """The rows as CSV with a header line; an empty group value is an empty field."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    names = columns(report)
    writer.writerow(names)
    for row in report["rows"]:
        writer.writerow(["" if row[name] is None else row[name] for name in names])
    return out.getvalue()


def as_table(report: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and rows for a person: hours and money, then a total line."""
    head = ["period"] if report["period"] != "none" else []
    money_name = report["currency"] or "cost"
    names = [*head, *report["group_by"], "GPU-hours", "node-hours", money_name, "unpriced GPU-h", "reserved GPU-h", f"reserved {money_name}"]

    def cells(figures: dict[str, Any]) -> list[str]:
        return [
            f"{figures['gpu_hours']:,.3f}",
            f"{figures['node_hours']:,.3f}",
            f"{figures['cost']:,.2f}",
            f"{figures['unpriced_gpu_hours']:,.3f}",
            f"{figures['reserved_gpu_hours']:,.3f}",
            f"{figures['reserved_cost']:,.2f}",
        ]

    rows = []
    for row in report["rows"]:
        period = [row["period_start"][:10] if row.get("period_start") else "-"] if head else []
        rows.append([*period, *("-" if row[k] is None else str(row[k]) for k in report["group_by"]), *cells(row)])
    blank = [""] * (len(head) + len(report["group_by"]))
    if blank:
        blank[0] = "total"
    rows.append([*blank, *cells(report["total"])] if blank else cells(report["total"]))
    return names, rows
