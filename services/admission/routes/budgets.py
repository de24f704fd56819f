"""Every budget of the active bundle in its current window: `GET /v1/budgets` (the same reading
the budget gauges show, budgetgate.services.admission.metrics)."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from budgetgate.edge.auth import Action, Principal, allow
from budgetgate.reports.budgets import list_budgets
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.services.admission.access import sees_budget

router = APIRouter()


@router.get("/v1/budgets", responses={503: {"description": "no policy bundle applied yet, or Postgres unavailable"}})
async def budgets(request: Request, principal: Principal = Depends(allow(Action.READ))) -> JSONResponse:
    """Every budget of the active bundle in its current window: limit, reserved, consumed,
    remaining (in hours, or the currency), used % and state (ok, alerting, exhausted, held).
    A principal limited to namespaces or tenants sees only the budgets within its limits."""
    rt = request.app.state.rt
    bundle = rt.policies.current
    if bundle is not None and not principal.unscoped:
        label = rt.settings.tenant_label
        bundle = bundle.restricted_to(lambda policy: sees_budget(principal, policy.scope, tenant_label=label))
    if bundle is None:
        return JSONResponse({"detail": "no policy bundle has been applied yet"}, status_code=503, headers={"Retry-After": "1"})
    try:
        found = await list_budgets(rt.pool, bundle, datetime.now(UTC))
    except BACKEND_ERRORS as exc:
        return JSONResponse({"detail": f"Postgres unavailable: {exc}"}, status_code=503, headers={"Retry-After": "1"})
    return JSONResponse({"policy_bundle_sha": bundle.git_sha, "budgets": found})
