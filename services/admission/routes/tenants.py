"""`GET` and `PUT /v1/tenants/{tenant}`: a tenant's quotas and budgets in force and where each
comes from, and overrides of them by an operator or an accounting system's service token.

An update is one new override revision, committed under the ledger lock (override_store.update):
the next batch of decisions, on any instance, reads the new revision in the call that begins it
and decides under it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from budgetgate.edge.auth import Action, Forbidden, Principal, allow
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.core.overrides import FIELDS, InvalidOverride, OverrideSet, UnknownTenant, git_values
from budgetgate.core.policy import PolicyBundle
from budgetgate.core.windows import rfc3339
from budgetgate.policies.override_store import NoActiveBundle, active_bundle, load, update
from budgetgate.services.admission.admitter import Unavailable
from budgetgate.contracts.admission import Problem
from budgetgate.contracts.tenants import TenantSettingsIn, TenantSettingsOut, label_value_path

router = APIRouter()
Tenant = label_value_path("tenant")


def settings_view(bundle: PolicyBundle, overrides: OverrideSet, tenant: str, *, label: str) -> dict[str, Any]:
    """A tenant's settings in force: each override over the Git bundle's value."""
    git = git_values(bundle, tenant, label=label)
    mine = overrides.tenants.get(tenant)
    settings = {}
    for name in FIELDS:
        value, policy_id = git[name]
        override = mine.fields.get(name) if mine is not None else None
        source = "override" if override is not None else "git" if value is not None else "unset"
        settings[name] = {
            "value": override.value if override is not None else value,
            "source": source,
            "git": value,
            "policy_id": override.policy_id if override is not None and override.policy_id else policy_id,
        }
    return {
        "tenant": tenant,
        "label": label,
        "policy_bundle_sha": bundle.git_sha,
        "override_revision": overrides.revision,
        "revision": mine.revision if mine is not None else None,
        "changed_by": mine.actor if mine is not None else None,
        "changed_at": rfc3339(mine.changed_at) if mine is not None and mine.changed_at is not None else None,
        "settings": settings,
    }


def _within(principal: Principal, tenant: str) -> None:
    principal.require_tenant(tenant)
    if principal.namespaces and not principal.tenants:
        raise Forbidden(f"{principal.name!r} is limited to namespaces {', '.join(principal.namespaces)}; a tenant's settings span namespaces")


@router.get("/v1/tenants/{tenant}", response_model=TenantSettingsOut, responses={403: {"model": Problem}, 503: {"model": Problem}})
async def get_tenant(request: Request, tenant: str = Tenant, principal: Principal = Depends(allow(Action.READ))) -> JSONResponse:
    """The tenant's quotas and budgets in force, each with its source (Git or override)."""
    _within(principal, tenant)
    rt = request.app.state.rt
    try:
        async with rt.pool.acquire() as conn:
            bundle = await active_bundle(conn)
            overrides = await load(conn)
    except NoActiveBundle as exc:
        raise Unavailable(str(exc)) from exc
    except BACKEND_ERRORS as exc:
        raise Unavailable(f"Postgres unavailable: {exc}") from exc
    return JSONResponse(settings_view(bundle, overrides, tenant, label=rt.settings.tenant_label))


@router.put(
    "/v1/tenants/{tenant}",
    response_model=TenantSettingsOut,
    responses={403: {"model": Problem}, 404: {"model": Problem}, 409: {"model": Problem}, 422: {}, 503: {"model": Problem}},
)
async def update_tenant(
    body: TenantSettingsIn,
    request: Request,
    tenant: str = Tenant,
    create: bool = Query(False, description="a tenant the Git bundle does not name and that has no overrides is refused (404) unless this is true"),
    principal: Principal = Depends(allow(Action.OVERRIDE)),
) -> JSONResponse:
    """Override some of the tenant's quotas and budgets (null: back to Git's value); hard quotas
    apply from the very next decision. Reductions below current use preempt nothing. A tenant
    neither Git nor an override names is refused, unless `create=true` says it is a new one."""
    _within(principal, tenant)
    rt = request.app.state.rt
    label = rt.settings.tenant_label
    try:
        async with rt.pool.acquire() as conn:
            bundle, overrides = await update(conn, tenant=tenant, changes=body.changes(), label=label, actor=principal.name, reason=body.reason, create=create)
    except UnknownTenant as exc:
        return JSONResponse({"detail": str(exc)}, status_code=404)
    except InvalidOverride as exc:
        return JSONResponse({"detail": [{"loc": ["body", exc.field], "msg": str(exc), "type": "value_error"}]}, status_code=422)
    except NoActiveBundle as exc:
        return JSONResponse({"detail": str(exc)}, status_code=409)
    except BACKEND_ERRORS as exc:
        raise Unavailable(f"Postgres unavailable: {exc}") from exc
    rt.policies.adopt(bundle, overrides)
    return JSONResponse(settings_view(bundle, overrides, tenant, label=label))
