"""Usage by tenant and by user: `GET /v1/tenants/{tenant}/usage?days=90` and
`GET /v1/users/{user}/usage?days=90`. A tenant is the value of one label (`team` unless
BUDGETGATE_TENANT_LABEL says otherwise), a user the value of another (`user` unless
BUDGETGATE_USER_LABEL says otherwise), both read alike (budgetgate.reports.usage.labelled_usage):
the budgets whose scope requires that label value in their current windows, and the runs'
reservations and metered usage over the last `days` days."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import asyncpg
from fastapi import APIRouter, Depends, Query, Request

from budgetgate.contracts.tenants import label_value_path
from budgetgate.core.policy import PolicyBundle
from budgetgate.edge.auth import Action, Forbidden, Principal, allow
from budgetgate.reports.usage import UserSettings, labelled_usage
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.runtime.settings import CommonSettings
from budgetgate.services.admission.admitter import Unavailable
from budgetgate.services.admission.routes.tenants import Tenant


async def tenant_usage(pool: asyncpg.Pool, bundle: PolicyBundle | None, *, label: str, tenant: str, days: int, now: datetime) -> dict[str, Any]:
    """Budgets of the tenant in their current windows, and its runs' usage since `days` ago (read
    only by callers not limited to namespaces: every budget requiring the tenant is theirs)."""
    return await labelled_usage(pool, bundle, who="tenant", label=label, value=tenant, days=days, now=now)


def router(settings: CommonSettings) -> APIRouter:
    """GET /v1/tenants/{tenant}/usage and GET /v1/users/{user}/usage, by the labels of `settings`."""
    tenant_label = settings.tenant_label
    user_label = getattr(settings, "user_label", None) or UserSettings().user_label
    api = APIRouter()

    @api.get("/v1/tenants/{tenant}/usage", tags=["usage"])
    async def tenant(
        request: Request, tenant: str = Tenant, days: int = Query(90, ge=1, le=3660), principal: Principal = Depends(allow(Action.READ))
    ) -> dict[str, Any]:
        principal.require_tenant(tenant)
        if principal.namespaces:
            # The run totals count the tenant's runs in every namespace (tenants too limited
            # would see runs outside their namespaces); `GET /v1/budgets` shows what is within.
            raise Forbidden(
                f"{principal.name!r} is limited to namespaces {', '.join(principal.namespaces)}; a tenant's usage spans namespaces "
                "(GET /v1/budgets lists the budgets within them)"
            )
        rt = request.app.state.rt
        try:
            return await tenant_usage(rt.pool, rt.policies.current, label=tenant_label, tenant=tenant, days=days, now=datetime.now(UTC))
        except BACKEND_ERRORS as exc:
            raise Unavailable(f"Postgres unavailable: {exc}") from exc

    @api.get("/v1/users/{user}/usage", tags=["usage"])
    async def user_usage(
        request: Request,
        user: str = label_value_path("user"),
        days: int = Query(90, ge=1, le=3660),
        principal: Principal = Depends(allow(Action.READ)),
    ) -> dict[str, Any]:
        if not principal.unscoped:
            # A user's runs may be in any tenant and namespace: a limited caller would see more than its limits.
            raise Forbidden(f"{principal.name!r} is limited to namespaces or tenants; a user's usage spans them all")
        rt = request.app.state.rt
        try:
            return await labelled_usage(rt.pool, rt.policies.current, who="user", label=user_label, value=user, days=days, now=datetime.now(UTC))
        except BACKEND_ERRORS as exc:
            raise Unavailable(f"Postgres unavailable: {exc}") from exc

    return api
