"""`POST /v1/policies`: an operator applies a policy bundle over HTTP (CI or a GitOps controller
then needs an operator token, not the ledger database's credentials). The documents are
validated here exactly as `budgetgate policy validate` does; Postgres records who applied which
Git SHA (policy_bundles.applied_by and the admin log)."""

from __future__ import annotations

import json

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from budgetgate.edge.auth import Action, Forbidden, Principal, allow
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.core.loader import PolicyValidationError, bundle_from_json
from budgetgate.ledger.queries import owned_by
from budgetgate.policies.override_store import plan_with_overrides
from budgetgate.core.policy_plan import emptiness
from budgetgate.policies.repository import RepositoryError, apply_bundle
from budgetgate.services.admission.admitter import Unavailable
from budgetgate.contracts.admission import BundleIn
from budgetgate.core.policy_files import SourceDocument

sql = owned_by("budgetgate.services.admission")

router = APIRouter()


@router.post(
    "/v1/policies",
    responses={
        409: {"description": "refused: empty, or the SHA names other content"},
        422: {"description": "documents that do not validate"},
    },
)
async def apply_policies(body: BundleIn, request: Request, principal: Principal = Depends(allow(Action.ADMINISTER))) -> JSONResponse:
    """Validate, plan and apply a bundle; answers the plan and the activation."""
    if not principal.unscoped:
        # A bundle sets every namespace's and tenant's budgets: a token limited to some may not.
        raise Forbidden(
            f"{principal.name!r} is limited to {principal.limits}; a policy bundle covers every namespace and tenant, "
            "so applying one needs a token without limits"
        )
    rt = request.app.state.rt
    documents_json = json.dumps([d.model_dump() for d in body.documents], default=str, sort_keys=True)
    try:
        bundle = bundle_from_json(documents_json, git_sha=body.git_sha)
    except PolicyValidationError as exc:
        return JSONResponse({"detail": [{"loc": ["body", "documents"], "msg": str(e), "type": "policy_error"} for e in exc.errors]}, status_code=422)
    documents = [SourceDocument(d.file, d.line, d.data, {}) for d in body.documents]
    try:
        async with rt.pool.acquire() as conn:
            row = await conn.fetchrow(sql("active_bundle"))
            active = bundle_from_json(row["documents"], git_sha=row["git_sha"]) if row else None
            changes = await plan_with_overrides(conn, active, bundle)
            empty = emptiness(active, bundle, len(documents))
            if empty and not body.allow_empty:
                return JSONResponse({"detail": f"refused: {empty}; send allow_empty if that is what you mean"}, status_code=409)
            try:
                seq = await apply_bundle(conn, bundle=bundle, documents=documents, source=body.source, applied_by=principal.name)
            except RepositoryError as exc:
                return JSONResponse({"detail": str(exc)}, status_code=409)
    except BACKEND_ERRORS as exc:
        raise Unavailable(f"Postgres unavailable: {exc}") from exc
    await rt.policies.refresh()
    return JSONResponse({
        "git_sha": bundle.git_sha,
        "activation": seq,
        "applied_by": principal.name,
        "previous_sha": active.git_sha if active else None,
        "changes": [str(c) for c in changes],
        "budgets": len(bundle.policies),
    })  # fmt: skip
