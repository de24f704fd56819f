"""What applying a bundle changes against the active one: budgets, quotas, pools and rates
added, removed or changed, with before -> after; and the tenant overrides it keeps or clears."""

from __future__ import annotations

from calendar import month_name
from collections.abc import Iterable
from dataclasses import dataclass, fields

from budgetgate.core.overrides import Fate
from budgetgate.core.policy import BudgetPolicy, PolicyBundle
from budgetgate.core.units import Unit, from_amount
from budgetgate.core.windows import WindowSpec


@dataclass(frozen=True, slots=True)
class Change:
    """One line of a plan: `kind` (budget, quota, pool, rate, cluster, sensitive pool) `name` was
    added, removed or changed; `before` and `after` describe it (None where it does not exist).
    A tenant override is `kept` or `cleared`, `after` saying why."""

    kind: str
    name: str
    action: str
    before: str | None
    after: str | None

    def __str__(self) -> str:
        sign = {"added": "+", "removed": "-", "changed": "~", "kept": "=", "cleared": "-"}[self.action]
        if self.action in ("kept", "cleared"):
            return f"{sign} {self.kind} {self.name}: {self.before} ({self.action}: {self.after})"
        if self.action == "changed":
            return f"{sign} {self.kind} {self.name}: {self.before} -> {self.after}"
        return f"{sign} {self.kind} {self.name}: {self.after if self.action == 'added' else self.before}"


def limit_text(policy: BudgetPolicy) -> str:
    unit = policy.limit.unit
    figure = from_amount(unit, policy.limit.amount).normalize()
    shown = f"{figure:f}"
    return f"{shown} {policy.limit.currency}" if unit is Unit.COST else f"{shown} {unit.value.replace('_', '-')}"


def window_text(window: WindowSpec) -> str:
    if window.rolling_days is not None:
        return f"rolling {window.rolling_days} days"
    if window.start_month is not None:
        return f"fiscal year from {month_name[window.start_month]} ({window.timezone})"
    return f"{window.calendar} ({window.timezone})"


def _budget(policy: BudgetPolicy) -> dict[str, str]:
    window = policy.window
    return {
        "limit": limit_text(policy),
        "scope": policy.scope.scope_id,
        "window": window_text(window),
        "enforcement": str(policy.enforcement),
        "on_exhausted": str(policy.on_exhausted),
    }


def _record(item: object, skip: Iterable[str] = ("id", "source")) -> dict[str, str]:
    return {f.name: str(getattr(item, f.name)) for f in fields(item) if f.name not in skip and getattr(item, f.name) is not None}  # type: ignore[arg-type]


def _items(bundle: PolicyBundle | None) -> dict[tuple[str, str], dict[str, str]]:
    if bundle is None:
        return {}
    items: dict[tuple[str, str], dict[str, str]] = {}
    for policy in bundle.policies:
        items[("budget", policy.id)] = _budget(policy)
    for quota in bundle.quotas:
        items[("quota", quota.id)] = _record(quota)
    for pool in bundle.pools:
        items[("pool", pool.id)] = _record(pool)
    if bundle.cluster is not None:
        items[("cluster", bundle.cluster.id)] = _record(bundle.cluster)
    if bundle.sensitive is not None:
        items[("sensitive pool", bundle.sensitive.id)] = _record(bundle.sensitive)
    for card in bundle.rate_cards:
        for rate in card.rates:
            name = rate.flavor + (f" in {rate.region}" if rate.region else "") + (f" from {rate.effective_from.isoformat()}" if rate.effective_from else "")
            items[("rate", name)] = {"rate": f"{rate.rate_per_gpu_hour.normalize():f} {card.currency}/GPU-hour"}
    return items


def _describe(record: dict[str, str]) -> str:
    if set(record) == {"rate"}:
        return record["rate"]
    if "limit" in record:
        return f"{record['limit']} per {record['window']} on {record['scope']}, {record['enforcement']}, on exhausted {record['on_exhausted']}"
    return ", ".join(f"{k} {v}" for k, v in record.items())


def plan(active: PolicyBundle | None, new: PolicyBundle) -> list[Change]:
    """The changes from `active` (None: nothing applied yet) to `new`, in a stable order."""
    before, after = _items(active), _items(new)
    changes = []
    for key in sorted(before.keys() | after.keys()):
        old, now = before.get(key), after.get(key)
        if old == now:
            continue
        if old is None:
            changes.append(Change(*key, "added", None, _describe(now)))  # type: ignore[arg-type]
        elif now is None:
            changes.append(Change(*key, "removed", _describe(old), None))
        else:
            differ = [k for k in dict.fromkeys([*old, *now]) if old.get(k) != now.get(k)]
            changes.append(Change(*key, "changed", "; ".join(f"{k} {old.get(k, '-')}" for k in differ), "; ".join(f"{k} {now.get(k, '-')}" for k in differ)))
    return changes


def emptiness(active: PolicyBundle | None, new: PolicyBundle, document_count: int) -> str | None:
    """Why applying `new` would leave nothing enforced, or None: an empty bundle, or one that
    removes every budget of the active one."""
    if document_count == 0:
        return "the bundle holds no budgetgate documents"
    if not new.policies and active is not None and active.policies:
        return f"the bundle removes every budget ({len(active.policies)} active)"
    return None


def override_changes(fates: Iterable[Fate]) -> list[Change]:
    """The plan's lines for tenant overrides: each kept or cleared, and why."""
    return [Change("override", f"{f.tenant} {f.field}", "kept" if f.kept else "cleared", f"{f.override.value:g}", f.why) for f in fates]
