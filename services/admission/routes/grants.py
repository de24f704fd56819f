"""`POST` and `GET /v1/budgets/{policy_id}/grants`: hours (or money) granted to one budget in one
window, or taken from it, by an operator or an accounting token, with a reason; and the grants
made. A grant is one new override revision, committed under the ledger lock
(grant_store.add): the next batch of decisions, on any instance, reads it and decides under the
window's new limit; reservations already made are untouched."""

from __future__ import annotations

from datetime import UTC, datetime

from fastapi import APIRouter, Depends, Path, Query, Request
from fastapi.responses import JSONResponse

from budgetgate.contracts.admission import Problem
from budgetgate.contracts.budget_grants import GrantIn, GrantList, GrantOut
from budgetgate.core.grants import InvalidGrant, UnknownBudget
from budgetgate.edge.auth import Action, Principal, allow
from budgetgate.policies.grant_store import add, listed
from budgetgate.policies.override_store import NoActiveBundle
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.services.admission.access import require_budget_scope
from budgetgate.services.admission.admitter import Unavailable

router = APIRouter()
PolicyId = Path(min_length=1, max_length=253, description="the budget's policy id (it may contain slashes)")


def _invalid(exc: InvalidGrant) -> JSONResponse:
    if isinstance(exc, UnknownBudget):
        return JSONResponse({"detail": str(exc)}, status_code=404)
    return JSONResponse({"detail": [{"loc": ["body", exc.field], "msg": str(exc), "type": "value_error"}]}, status_code=422)


def _within(request: Request, principal: Principal, policy_id: str) -> None:
    """A principal limited to namespaces or tenants touches only the budgets within them."""
    bundle = request.app.state.rt.policies.current
    policy = next((p for p in bundle.policies if p.id == policy_id), None) if bundle is not None else None
    if policy is not None and not principal.unscoped:
        require_budget_scope(principal, policy.scope, tenant_label=request.app.state.rt.settings.tenant_label)


@router.post(
    "/v1/budgets/{policy_id:path}/grants",
    response_model=GrantOut,
    responses={403: {"model": Problem}, 404: {"model": Problem}, 409: {"model": Problem}, 422: {}, 503: {"model": Problem}},
)
async def grant_budget(body: GrantIn, request: Request, policy_id: str = PolicyId, principal: Principal = Depends(allow(Action.GRANT))) -> JSONResponse:
    """Add hours (or money) to a budget's limit in its current window or a named one, or take
    them away (a negative amount), with a reason. Effective from the next decision on every
    instance; reservations already made are untouched. An unknown budget is a 404; a zero amount,
    a window that has ended, a rolling window, or a limit that would go below zero a 422."""
    _within(request, principal, policy_id)
    rt = request.app.state.rt
    try:
        async with rt.pool.acquire() as conn:
            grant, bundle, overrides = await add(
                conn, policy_id=policy_id, scope_id=body.scope_id, window=body.window, value=body.amount, reason=body.reason,
                actor=principal.name, now=datetime.now(UTC),
            )  # fmt: skip
    except InvalidGrant as exc:
        return _invalid(exc)
    except NoActiveBundle as exc:
        return JSONResponse({"detail": str(exc)}, status_code=409)
    except BACKEND_ERRORS as exc:
        raise Unavailable(f"Postgres unavailable: {exc}") from exc
    rt.policies.adopt(bundle, overrides)
    return JSONResponse(grant.view())


@router.get(
    "/v1/budgets/{policy_id:path}/grants",
    response_model=GrantList,
    responses={403: {"model": Problem}, 404: {"model": Problem}, 409: {"model": Problem}, 503: {"model": Problem}},
)
async def list_grants(
    request: Request,
    policy_id: str = PolicyId,
    window: str | None = Query(None, max_length=100, description="only this window's grants: its key, or a date or instant inside it"),
    principal: Principal = Depends(allow(Action.READ)),
) -> JSONResponse:
    """The grants made to a budget, oldest first: amount, the window's limit before and after,
    who and why."""
    _within(request, principal, policy_id)
    rt = request.app.state.rt
    try:
        async with rt.pool.acquire() as conn:
            bundle, grants = await listed(conn, policy_id=policy_id, window=window, now=datetime.now(UTC))
    except InvalidGrant as exc:
        if isinstance(exc, UnknownBudget):
            return JSONResponse({"detail": str(exc)}, status_code=404)
        return JSONResponse({"detail": [{"loc": ["query", exc.field], "msg": str(exc), "type": "value_error"}]}, status_code=422)
    except NoActiveBundle as exc:
        return JSONResponse({"detail": str(exc)}, status_code=409)
    except BACKEND_ERRORS as exc:
        raise Unavailable(f"Postgres unavailable: {exc}") from exc
    return JSONResponse({"policy_id": policy_id, "policy_bundle_sha": bundle.git_sha, "grants": [g.view() for g in grants]})
