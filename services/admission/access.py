"""What a principal may see and do in admission's terms: a submission's namespace and tenant,
a budget's scope, a stored decision."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from budgetgate.core.policy import Scope
from budgetgate.core.principals import Forbidden, Principal
from budgetgate.ledger.archive import ArchivedDecision


def require_submission(principal: Principal, *, namespace: str, labels: Mapping[str, str], tenant_label: str) -> None:
    """A submission (or a stored decision) in `namespace` with `labels` is within the principal's limits."""
    principal.require_namespace(namespace)
    principal.require_tenant(labels.get(tenant_label))


def require_budget_scope(principal: Principal, scope: Scope, *, tenant_label: str) -> None:
    """Every namespace a budget covers, and its tenant, are within the principal's limits; a
    budget over every namespace is visible only to a principal not limited to namespaces."""
    if principal.namespaces and not scope.namespaces:
        raise Forbidden(f"{principal.name!r} is limited to namespaces {', '.join(principal.namespaces)}; scope {scope.scope_id!r} covers every namespace")
    for namespace in sorted(scope.namespaces):
        principal.require_namespace(namespace)
    principal.require_tenant(scope.labels.get(tenant_label))


def sees_budget(principal: Principal, scope: Scope, *, tenant_label: str) -> bool:
    try:
        require_budget_scope(principal, scope, tenant_label=tenant_label)
    except Forbidden:
        return False
    return True


def archived_problem(principal: Principal, found: ArchivedDecision) -> dict[str, Any]:
    """The 410 of a run whose latest decision is archived. Its namespace and tenant went with it,
    so a principal limited to some is told only that (not when, nor where the archive is)."""
    if principal.namespaces or principal.tenants:
        return {"detail": f"run {found.run_id!r}'s latest decision is archived; an operator can restore its month (`budgetgate ledger restore`)"}
    return found.problem()
