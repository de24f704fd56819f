"""Tenant overrides: quotas and budget limits changed over the API on top of the Git bundle.

An override replaces one setting of one tenant: a hard quota (`max_gpus`, `max_nodes`,
`max_concurrent_allocations`), a fair-share term (`fair_share_target`, `burst_allowance`), or
the limit of the tenant's soft GPU-hour or node-hour budget (`gpu_hours_budget`,
`node_hours_budget`: the one soft BudgetPolicy of that unit whose scope requires the tenant's
label value). Each override remembers the Git value it was set against, which decides what a
later Git apply does with it (`after_apply`): Git changing that setting clears the override,
Git leaving it alone keeps it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from pydantic import ValidationError

from budgetgate.core.documents import QuotaSpec
from budgetgate.core.policy import ANY_VALUE, BudgetPolicy, Enforcement, Grant, PolicyBundle
from budgetgate.core.quotas import QUOTA_FIELDS, TenantQuota
from budgetgate.core.sources import Source
from budgetgate.core.units import Unit, from_amount, limit_amount, smallest

SHARE_FIELDS = ("fair_share_target", "burst_allowance")
BUDGET_FIELDS: Mapping[str, Unit] = {"gpu_hours_budget": Unit.GPU_HOURS, "node_hours_budget": Unit.NODE_HOURS}
FIELDS = ("max_nodes", "max_gpus", "max_concurrent_allocations", "gpu_hours_budget", "node_hours_budget", "fair_share_target", "burst_allowance")
HARD_FIELDS = QUOTA_FIELDS
Value = int | float


class InvalidOverride(ValueError):
    """An override that cannot be set against the active bundle; `field` names the culprit."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(message)
        self.field = field_name


@dataclass(frozen=True, slots=True)
class Override:
    """One setting of one tenant: `value` replaces Git's `git` (None: Git has none). Budget
    overrides name the policy whose limit they replace, and the tenant label its scope required
    (`label`: None for overrides recorded before it was kept)."""

    value: Value
    git: Value | None
    policy_id: str | None = None
    label: str | None = None

    def amount(self, unit: Unit) -> int:
        """A budget override's limit in ledger units, rounded down like a Git limit."""
        return limit_amount(unit, self.value)


@dataclass(frozen=True, slots=True)
class TenantOverrides:
    """A tenant's overrides at the revision that last changed them."""

    tenant: str
    fields: Mapping[str, Override]
    revision: int
    actor: str = ""
    changed_at: datetime | None = None


@dataclass(frozen=True, slots=True)
class OverrideSet:
    """Every tenant's overrides at one revision (0: none was ever made), and the budget grants
    made up to it (core/grants.py; they share the revision sequence), by (policy id, ledger key)."""

    revision: int = 0
    tenants: Mapping[str, TenantOverrides] = field(default_factory=dict)
    grants: Mapping[tuple[str, str], tuple[Grant, ...]] = field(default_factory=dict)

    def of(self, tenant: str) -> Mapping[str, Override]:
        found = self.tenants.get(tenant)
        return found.fields if found is not None else {}


NO_OVERRIDES = OverrideSet()


def tenant_budget(bundle: PolicyBundle, tenant: str, unit: Unit, *, label: str) -> BudgetPolicy | None:
    """The tenant's soft budget in `unit`: the one soft policy of that unit whose scope requires
    `label` = `tenant`. Raises InvalidOverride when several qualify (which one is meant?)."""
    found = [p for p in bundle.policies if p.enforcement is Enforcement.SOFT and p.limit.unit is unit and p.scope.labels.get(label) == tenant]
    if len(found) > 1:
        name = _budget_field(unit)
        raise InvalidOverride(name, f"tenant {tenant!r} has {len(found)} soft {unit} budgets ({', '.join(p.id for p in found)}); an override needs exactly one")
    return found[0] if found else None


class UnknownTenant(LookupError):
    """An update for a tenant that neither the bundle nor an override names: a typo, until the
    caller says it means a new tenant."""


def named_tenants(bundle: PolicyBundle, *, label: str) -> set[str]:
    """The tenants the bundle names: in a Quota, or as the value of `label` in a budget's scope."""
    named = {q.tenant for q in bundle.quotas if q.tenant}
    named |= {value for p in bundle.policies if (value := p.scope.labels.get(label)) is not None and value != ANY_VALUE}
    return named


def _budget_field(unit: Unit) -> str:
    return next(name for name, u in BUDGET_FIELDS.items() if u is unit)


def budget_hours(policy: BudgetPolicy) -> float:
    return float(from_amount(policy.limit.unit, policy.limit.amount))


def git_values(bundle: PolicyBundle, tenant: str, *, label: str) -> dict[str, tuple[Value | None, str | None]]:
    """Every setting of `tenant` as Git has it: (value, the policy id of a budget)."""
    quota = bundle.quota_for(tenant)
    found: dict[str, tuple[Value | None, str | None]] = {}
    for name in FIELDS:
        if name in BUDGET_FIELDS:
            try:
                policy = tenant_budget(bundle, tenant, BUDGET_FIELDS[name], label=label)
            except InvalidOverride:
                policy = None
            found[name] = (budget_hours(policy), policy.id) if policy is not None else (None, None)
        else:
            found[name] = (getattr(quota, name) if quota is not None else None, None)
    return found


def updated(current: Mapping[str, Override], changes: Mapping[str, Value | None], bundle: PolicyBundle, tenant: str, *, label: str) -> dict[str, Override]:
    """The tenant's overrides after `changes` (a field set to None goes back to Git's value);
    raises InvalidOverride when the result cannot apply to `bundle`."""
    result = dict(current)
    for name, value in changes.items():
        if value is None:
            result.pop(name, None)
            continue
        if name in BUDGET_FIELDS:
            unit = BUDGET_FIELDS[name]
            policy = tenant_budget(bundle, tenant, unit, label=label)
            if policy is None:
                raise InvalidOverride(
                    name,
                    f"tenant {tenant!r} has no soft {unit} budget in bundle {bundle.git_sha} (a BudgetPolicy with enforcement: soft, a {unit} "
                    f"limit and scope label {label}: {tenant}); an override changes a budget's limit, it does not create one",
                )
            if value > 0 and limit_amount(unit, value) == 0:
                raise InvalidOverride(name, f"{value} is less than the ledger's unit ({smallest(unit)}), so it would be a limit of 0")
            result[name] = Override(value, budget_hours(policy), policy.id, label)
        else:
            quota = bundle.quota_for(tenant)
            result[name] = Override(value, getattr(quota, name) if quota is not None else None)
    check(result, bundle, tenant)
    return result


def check(overrides: Mapping[str, Override], bundle: PolicyBundle, tenant: str) -> None:
    """Raises InvalidOverride when the tenant's quota with `overrides` would not validate as a
    Quota document (a burst allowance without a target), or sets a fair share with no Cluster."""
    values = _quota_values(bundle.quota_for(tenant), overrides)
    if not any(v is not None for v in values.values()):
        return
    try:
        QuotaSpec(tenant=tenant, **values)
    except ValidationError as exc:
        error = exc.errors()[0]
        loc = [str(p) for p in error.get("loc", ())]
        culprit = next((p for p in loc if p in FIELDS), None) or next((n for n in SHARE_FIELDS if n in overrides), None) or next(iter(overrides), "tenant")
        raise InvalidOverride(culprit, error["msg"].removeprefix("Value error, ")) from None
    if values["fair_share_target"] is not None and bundle.cluster is None:
        raise InvalidOverride("fair_share_target", f"bundle {bundle.git_sha} has no kind: Cluster document, so a fair share has nothing to be a share of")


def _quota_values(quota: TenantQuota | None, overrides: Mapping[str, Override]) -> dict[str, Any]:
    names = (*QUOTA_FIELDS, *SHARE_FIELDS)
    return {n: overrides[n].value if n in overrides else (getattr(quota, n) if quota is not None else None) for n in names}


def effective(bundle: PolicyBundle, overrides: OverrideSet) -> PolicyBundle:
    """`bundle` with every override applied and the grants beside it; it keeps the bundle's Git
    SHA and names the override revision beside it."""
    quotas = {q.tenant: q for q in bundle.quotas}
    limits: dict[tuple[str, Unit], int] = {}
    for tenant, found in overrides.tenants.items():
        values = {n: o.value for n, o in found.fields.items() if n not in BUDGET_FIELDS}
        if values:
            base = quotas.get(tenant) or TenantQuota(f"override/{tenant}", tenant, None, None, None, None, None, Source("override", found.revision))
            quotas[tenant] = replace(base, **values)
        for name, unit in BUDGET_FIELDS.items():
            if name in found.fields and found.fields[name].policy_id is not None:
                limits[(found.fields[name].policy_id, unit)] = found.fields[name].amount(unit)  # type: ignore[index]
    policies = tuple(replace(p, limit=replace(p.limit, amount=limits[(p.id, p.limit.unit)])) if (p.id, p.limit.unit) in limits else p for p in bundle.policies)
    return replace(bundle, policies=policies, quotas=tuple(quotas.values()), override_revision=overrides.revision, grants=overrides.grants)


@dataclass(frozen=True, slots=True)
class Fate:
    """What a Git apply does with one override: kept, or cleared because Git changed the
    setting (or the budget it limits is gone) — `why` says which."""

    tenant: str
    field: str
    override: Override
    kept: bool
    git_after: Value | None
    why: str


def after_apply(overrides: OverrideSet, new: PolicyBundle) -> list[Fate]:
    """The rule for overrides when bundle `new` is applied: an override whose setting Git leaves
    as it was when the override was made is kept; one whose setting Git changes (or whose budget
    Git removes) is cleared, since Git's change is the newer word. A tenant whose kept overrides
    no longer validate against `new` (a fair share whose Cluster is gone) loses them all."""
    fates: list[Fate] = []
    for tenant in sorted(overrides.tenants):
        found = overrides.tenants[tenant].fields
        mine = [_fate(tenant, name, found[name], new) for name in FIELDS if name in found]
        kept = {f.field: f.override for f in mine if f.kept}
        try:
            check(kept, new, tenant)
        except InvalidOverride as exc:
            mine = [replace(f, kept=False, why=f"no longer valid with the new bundle: {exc}") if f.kept else f for f in mine]
        fates += mine
    return fates


def _fate(tenant: str, name: str, override: Override, new: PolicyBundle) -> Fate:
    if name in BUDGET_FIELDS:
        unit = BUDGET_FIELDS[name]
        policy = next((p for p in new.policies if p.id == override.policy_id and p.limit.unit is unit and p.enforcement is Enforcement.SOFT), None)
        if policy is None:
            return Fate(tenant, name, override, False, None, f"Git no longer has soft {unit} budget {override.policy_id!r}")
        if not _still_the_tenants(policy, tenant, override.label):
            # Re-scoped to another tenant (team: vision -> team: nlp): the override was granted
            # to this tenant, so it must not follow the policy id onto someone else's budget.
            return Fate(tenant, name, override, False, budget_hours(policy), f"Git re-scoped budget {policy.id!r} to {policy.scope.scope_id}")
        after: Value | None = budget_hours(policy)
    else:
        quota = new.quota_for(tenant)
        after = getattr(quota, name) if quota is not None else None
    if after == override.git:
        return Fate(tenant, name, override, True, after, f"Git unchanged at {_shown(after)}")
    return Fate(tenant, name, override, False, after, f"Git changes it: {_shown(override.git)} -> {_shown(after)}")


def _still_the_tenants(policy: BudgetPolicy, tenant: str, label: str | None) -> bool:
    """Whether `policy`'s scope still requires the tenant label = `tenant`. An override recorded
    without its label is judged by the label values alone."""
    if label is not None:
        return policy.scope.labels.get(label) == tenant
    return tenant in policy.scope.labels.values()


def _shown(value: Value | None) -> str:
    return "unset" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def to_json(fields: Mapping[str, Override]) -> dict[str, Any]:
    """A tenant's overrides as tenant_overrides.settings stores them."""
    stored: dict[str, Any] = {}
    for name, o in fields.items():
        stored[name] = {"value": o.value, "git": o.git}
        if name in BUDGET_FIELDS:
            unit = BUDGET_FIELDS[name]
            stored[name] |= {"policy_id": o.policy_id, "unit": str(unit), "amount": o.amount(unit)} | ({"label": o.label} if o.label is not None else {})
    return stored


def from_json(stored: Mapping[str, Any]) -> dict[str, Override]:
    return {name: Override(v["value"], v.get("git"), v.get("policy_id"), v.get("label")) for name, v in stored.items() if name in FIELDS}
