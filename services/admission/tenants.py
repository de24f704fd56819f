"""Usage by tenant: `GET /v1/tenants/{tenant}/usage?days=90`. A tenant is the value of one label
(`team` unless BUDGETGATE_TENANT_LABEL says otherwise): its budgets (policies whose scope requires
that label value) in their current windows, and its runs' reservations and metered usage over
the last `days` days."""

from __future__ import annotations

from datetime import datetime
from typing import Any

import asyncpg
from fastapi import Depends, FastAPI, Path, Query, Request

from budgetgate.auth import Action, Forbidden, Principal, allow
from budgetgate.core.policy import PolicyBundle, Scope
from budgetgate.services.admission.access import sees_budget
from budgetgate.services.admission.tenant_schemas import TENANT_PATTERN
from budgetgate.services.admission.usage import labelled_usage
from budgetgate.settings import CommonSettings

# A tenant in a path is a label value, as in every submission: anything else names no tenant.
TenantName = Path(pattern=TENANT_PATTERN, max_length=63, description="a value of the tenant label")


class TenantSettings(CommonSettings):
    tenant_label: str = "team"


async def tenant_usage(
    pool: asyncpg.Pool, bundle: PolicyBundle | None, *, label: str, tenant: str, days: int, now: datetime, principal: Principal | None = None
) -> dict[str, Any]:
    """Budgets of the tenant in their current windows (those `principal` may see, as
    `GET /v1/budgets` shows them), and its runs' usage since `days` ago."""

    def visible(scope: Scope) -> bool:
        return principal is None or sees_budget(principal, scope, tenant_label=label)

    return await labelled_usage(pool, bundle, who="tenant", label=label, value=tenant, days=days, now=now, visible=visible)


def add_tenant_routes(app: FastAPI, settings: CommonSettings) -> None:
    """Register GET /v1/tenants/{tenant}/usage on the admission app."""
    label = getattr(settings, "tenant_label", None) or TenantSettings().tenant_label

    @app.get("/v1/tenants/{tenant}/usage", tags=["usage"])
    async def tenant(
        request: Request, tenant: str = TenantName, days: int = Query(90, ge=1, le=3660), principal: Principal = Depends(allow(Action.READ))
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

        from budgetgate.backends import BACKEND_ERRORS
        from budgetgate.services.admission.admitter import Unavailable

        rt = request.app.state.rt
        try:
            return await tenant_usage(rt.pool, rt.policies.current, label=label, tenant=tenant, days=days, now=datetime.now(UTC), principal=principal)
        except BACKEND_ERRORS as exc:
            raise Unavailable(f"Postgres unavailable: {exc}") from exc
