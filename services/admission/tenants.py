"""Usage by tenant: `GET /v1/tenants/{tenant}/usage?days=90`. A tenant is the value of one label
(`team` unless BUDGETGATE_TENANT_LABEL says otherwise): its budgets (policies whose scope requires
that label value) in their current windows, and its runs' reservations and metered usage over
the last `days` days."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg
from fastapi import Depends, FastAPI, Query, Request

from budgetgate.edge.auth import Action, Forbidden, Principal, allow
from budgetgate.core.policy import PolicyBundle
from budgetgate.services.admission.tenant_admin import Tenant
from budgetgate.reports.usage import TenantSettings, labelled_usage
from budgetgate.runtime.settings import CommonSettings


async def tenant_usage(pool: asyncpg.Pool, bundle: PolicyBundle | None, *, label: str, tenant: str, days: int, now: datetime) -> dict[str, Any]:
    """Budgets of the tenant in their current windows, and its runs' usage since `days` ago (read
    only by callers not limited to namespaces: every budget requiring the tenant is theirs)."""
    return await labelled_usage(pool, bundle, who="tenant", label=label, value=tenant, days=days, now=now)


def add_tenant_routes(app: FastAPI, settings: CommonSettings) -> None:
    """Register GET /v1/tenants/{tenant}/usage on the admission app."""
    label = getattr(settings, "tenant_label", None) or TenantSettings().tenant_label

    @app.get("/v1/tenants/{tenant}/usage", tags=["usage"])
    async def tenant(
        request: Request, tenant: str = Tenant, days: int = Query(90, ge=1, le=3660), principal: Principal = Depends(allow(Action.READ))
    ) -> dict[str, Any]:
        from datetime import UTC

        principal.require_tenant(tenant)
        if principal.namespaces:
            # The run totals count the tenant's runs in every namespace (tenants too limited
            # would see runs outside their namespaces); `GET /v1/budgets` shows what is within.
            raise Forbidden(
                f"{principal.name!r} is limited to namespaces {', '.join(principal.namespaces)}; a tenant's usage spans namespaces "
                "(GET /v1/budgets lists the budgets within them)"
            )

        from budgetgate.runtime.backends import BACKEND_ERRORS
        from budgetgate.services.admission.admitter import Unavailable

        rt = request.app.state.rt
        try:
            return await tenant_usage(rt.pool, rt.policies.current, label=label, tenant=tenant, days=days, now=datetime.now(UTC))
        except BACKEND_ERRORS as exc:
            raise Unavailable(f"Postgres unavailable: {exc}") from exc
