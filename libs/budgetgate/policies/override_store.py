"""Tenant overrides in Postgres (tenant_overrides, migration 0015): reading the set at a revision,
changing one tenant's, and what a Git apply does with them — each change a new revision, logged
in the admin log, with the budget limits of open windows moved in the same transaction."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from budgetgate.core.loader import bundle_from_json
from budgetgate.core.overrides import (
    BUDGET_FIELDS,
    Fate,
    Override,
    OverrideSet,
    TenantOverrides,
    UnknownTenant,
    Value,
    after_apply,
    effective,
    from_json,
    named_tenants,
    to_json,
    updated,
)
from budgetgate.core.documents import did_you_mean
from budgetgate.core.grants import by_window, from_row
from budgetgate.core.policy import PolicyBundle
from budgetgate.ledger.queries import owned_by
from budgetgate.core.policy_plan import Change, override_changes, plan
from budgetgate.access.tokens import log_action

sql = owned_by("budgetgate.policies")


class NoActiveBundle(LookupError):
    """Overrides apply on top of a Git bundle; none has been applied yet."""


async def load(conn: Any, revision: int | None = None) -> OverrideSet:
    """Every tenant's overrides, and the budget grants, at `revision` (default: the latest)."""
    if revision is None:
        revision = await conn.fetchval(sql("override_revision"))
    tenants = {}
    for row in await conn.fetch(sql("overrides_at"), revision):
        fields = from_json(_json(row["settings"]))
        if fields:
            tenants[row["tenant"]] = TenantOverrides(row["tenant"], fields, row["revision"], row["actor"], row["changed_at"])
    grants = by_window(from_row(row) for row in await conn.fetch(sql("grants_at"), revision)) if revision else {}
    return OverrideSet(revision, tenants, grants)


def _json(value: Any) -> Any:
    return json.loads(value) if isinstance(value, str) else value


async def active_bundle(conn: Any) -> PolicyBundle:
    row = await conn.fetchrow(sql("active_bundle"))
    if row is None:
        raise NoActiveBundle("no policy bundle has been applied yet; overrides apply on top of one (`budgetgate policy apply`)")
    return bundle_from_json(row["documents"], git_sha=row["git_sha"])


async def decided_under(conn: Any) -> PolicyBundle | None:
    """The bundle decisions are made under now: the active Git bundle with the latest tenant
    overrides applied (None before any bundle was applied)."""
    try:
        return effective(await active_bundle(conn), await load(conn))
    except NoActiveBundle:
        return None


async def update(
    conn: Any, *, tenant: str, changes: Mapping[str, Value | None], label: str, actor: str, reason: str | None, create: bool = False
) -> tuple[PolicyBundle, OverrideSet]:
    """Set (or, for None, clear) overrides of `tenant` as one new revision; returns the active
    Git bundle and the override set after it. Raises InvalidOverride, NoActiveBundle, and
    UnknownTenant for a tenant neither the bundle nor a current override names, unless `create`.

    The ledger lock is taken exclusively for the write: a batch of decisions in flight finishes
    under the previous revision before the change commits, and every batch begun after reads
    the new one. (The override lock comes first, as in a Git apply, so the two never wait on
    each other in a cycle.)"""
    async with conn.transaction():
        await conn.execute(sql("lock_overrides"))
        bundle = await active_bundle(conn)
        current = await load(conn)
        if not create and tenant not in current.tenants:
            named = named_tenants(bundle, label=label)
            if tenant not in named:
                hint = did_you_mean(tenant, sorted(named | set(current.tenants)))
                raise UnknownTenant(
                    f"tenant {tenant!r} is not known: bundle {bundle.git_sha} names it in no Quota and no budget scope ({label}: {tenant}), "
                    f"and it has no overrides{hint}{'' if hint.endswith('?') else '.'} To give a new tenant quotas, send the update again with create=true."
                )
        before = current.of(tenant)
        after = updated(before, changes, bundle, tenant, label=label)
        await conn.execute(sql("lock_ledger_everywhere"))
        row = await conn.fetchrow(sql("insert_override"), tenant, json.dumps(to_json(after)), actor, "api", reason, bundle.git_sha)
        await _move_limits(conn, bundle, before, after)
        details = {
            "revision": row["revision"],
            "git_sha": bundle.git_sha,
            "before": to_json(before),
            "after": to_json(after),
            "reason": reason,
        }
        await log_action(conn, actor=actor, action="tenant.override", subject=tenant, details=details)
        tenants = dict(current.tenants)
        tenants[tenant] = TenantOverrides(tenant, after, row["revision"], actor, row["changed_at"])
    return bundle, OverrideSet(row["revision"], {t: o for t, o in tenants.items() if o.fields}, current.grants)


async def _move_limits(conn: Any, bundle: PolicyBundle, before: Mapping[str, Override], after: Mapping[str, Override]) -> None:
    """Open windows of the budgets whose override changed take the limit now in force."""
    for name, unit in BUDGET_FIELDS.items():
        old, new = before.get(name), after.get(name)
        if old == new:
            continue
        for override in (o for o in (old, new) if o is not None and o.policy_id):
            policy = next((p for p in bundle.policies if p.id == override.policy_id and p.limit.unit is unit), None)
            if policy is None:
                continue
            amount = new.amount(unit) if new is not None and new.policy_id == policy.id else policy.limit.amount
            await conn.execute(sql("update_policy_limits"), policy.id, amount, bundle.git_sha, str(unit))


async def plan_with_overrides(conn: Any, active: PolicyBundle | None, new: PolicyBundle) -> list[Change]:
    """What applying `new` changes (policy_plan.plan), then what it does with the overrides."""
    return plan(active, new) + override_changes(after_apply(await load(conn), new))


async def after_git_apply(conn: Any, *, new: PolicyBundle, applied_by: str) -> list[Fate]:
    """Within a Git apply's transaction, after Git's limits were set: keep or clear every
    override by the rule of core.overrides.after_apply, record each tenant whose set changed as a
    new revision and in the admin log, and put kept budget overrides back on the open windows."""
    await conn.execute(sql("lock_overrides"))
    current = await load(conn)
    fates = after_apply(current, new)
    by_tenant: dict[str, list[Fate]] = {}
    for fate in fates:
        by_tenant.setdefault(fate.tenant, []).append(fate)
    for tenant, mine in by_tenant.items():
        kept = {f.field: f.override for f in mine if f.kept}
        for name, unit in BUDGET_FIELDS.items():
            if name in kept and kept[name].policy_id:
                await conn.execute(sql("update_policy_limits"), kept[name].policy_id, kept[name].amount(unit), new.git_sha, str(unit))
        cleared = [f for f in mine if not f.kept]
        if not cleared:
            continue
        row = await conn.fetchrow(sql("insert_override"), tenant, json.dumps(to_json(kept)), applied_by, "policy.apply", None, new.git_sha)
        details = {"revision": row["revision"], "git_sha": new.git_sha, "cleared": {f.field: f.why for f in cleared}, "kept": sorted(kept)}
        await log_action(conn, actor=applied_by, action="tenant.override.clear", subject=tenant, details=details)
    return fates
