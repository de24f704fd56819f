"""Budget grants in Postgres (budget_grants, migration 0031): making one, and listing them.

A grant is one new revision of the override sequence, committed with the admin log row and the
window's new limit on its ledger entry in one transaction, under the override lock and the
ledger lock taken exclusively, as a tenant override is (override_store.update): a batch of
decisions in flight finishes under the previous revision, and every batch begun after, on any
admission instance, reads the new one and decides under the new limit."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from budgetgate.access.tokens import log_action
from budgetgate.core.grants import Grant, ask, budget_of, window_of
from budgetgate.core.ledger_key import LedgerKey
from budgetgate.core.overrides import OverrideSet, effective
from budgetgate.core.policy import PolicyBundle
from budgetgate.core.units import display
from budgetgate.ledger.queries import owned_by
from budgetgate.policies.override_store import active_bundle, load

sql = owned_by("budgetgate.policies")


async def add(
    conn: Any, *, policy_id: str, scope_id: str | None, window: str | None, value: Any, reason: str | None, actor: str, now: datetime
) -> tuple[Grant, PolicyBundle, OverrideSet]:
    """Grant `value` (in the budget's unit; negative takes away) to budget `policy_id` for the
    window containing `now`, or the one `window` names. Returns the grant, the active Git bundle
    and the override set after it. Raises InvalidGrant (UnknownBudget) and NoActiveBundle;
    nothing is written then."""
    async with conn.transaction():
        await conn.execute(sql("lock_overrides"))
        bundle = await active_bundle(conn)
        current = await load(conn)
        asked = ask(effective(bundle, current), policy_id=policy_id, scope_id=scope_id, window=window, value=value, reason=reason, now=now)
        policy, unit = asked.policy, asked.policy.limit.unit
        await conn.execute(sql("lock_ledger_everywhere"))
        row = await conn.fetchrow(
            sql("insert_grant"), policy.id, policy.scope.scope_id, str(unit), asked.ledger_key, asked.window.start, asked.window.end,
            asked.amount, asked.limit_before, asked.limit_after, actor, reason, bundle.git_sha,
        )  # fmt: skip
        await conn.execute(sql("set_window_limit"), asked.ledger_key, asked.limit_after, policy.id)
        grant = Grant(
            row["revision"], policy.id, policy.scope.scope_id, unit, asked.ledger_key, asked.window.start, asked.window.end,
            asked.amount, asked.limit_before, asked.limit_after, actor, reason or "", row["granted_at"],
        )  # fmt: skip
        details = {
            "revision": grant.revision,
            "git_sha": bundle.git_sha,
            "ledger_key": grant.ledger_key,
            "unit": str(unit),
            "amount": display(unit, grant.amount),
            "before": {"limit": display(unit, grant.limit_before)},
            "after": {"limit": display(unit, grant.limit_after)},
            "reason": reason,
        }
        await log_action(conn, actor=actor, action="budget.grant", subject=policy.id, details=details)
    grants = dict(current.grants)
    grants[(policy.id, grant.ledger_key)] = (*current.grants.get((policy.id, grant.ledger_key), ()), grant)
    return grant, bundle, OverrideSet(grant.revision, current.tenants, grants)


async def listed(conn: Any, *, policy_id: str, window: str | None = None, now: datetime) -> tuple[PolicyBundle, list[Grant]]:
    """The grants made to budget `policy_id` (of the active bundle), oldest first; only those of
    one window when `window` names it (as `add` reads it). Raises InvalidGrant, NoActiveBundle."""
    bundle = await active_bundle(conn)
    current = await load(conn)
    policy = budget_of(bundle, policy_id)
    grants = [g for (pid, _), found in current.grants.items() if pid == policy.id for g in found]
    if window is not None:
        key = LedgerKey.text_of(policy, window_of(policy, window, now, ended=True))
        grants = [g for g in grants if g.ledger_key == key]
    return bundle, sorted(grants, key=lambda g: g.revision)
