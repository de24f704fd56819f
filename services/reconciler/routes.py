"""The reconciler's operator routes: the settlements it dead-lettered, with what their runs hold
(`GET /v1/settlements/dead-letters`), and their resolution by an operator
(`POST /v1/settlements/{run_id}/resolve`), through this process's own settler (dead_letters.py).

Both need the operator role and a token not limited to namespaces or tenants: dead letters are
of every tenant, and resolving one changes budgets whoever owns them. The actor logged in the
admin log is the caller's principal."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse

from budgetgate.contracts.settlements import RELEASE, DeadLetterList, ResolveIn, Resolved
from budgetgate.core.principals import Action, Forbidden, Principal
from budgetgate.edge.auth import allow
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.services.reconciler import dead_letters
from budgetgate.services.reconciler.dead_letters import NotDeadLettered, StillFailing

router = APIRouter()

_UNAVAILABLE = {503: {"description": "Postgres or Redis is unavailable; nothing changed, retry after Retry-After"}}


def _unlimited(principal: Principal = Depends(allow(Action.ADMINISTER))) -> Principal:
    if not principal.unscoped:
        raise Forbidden(
            f"{principal.name!r} is limited to {principal.limits}; dead-lettered settlements are of every namespace and tenant, "
            "so they need a token without limits"
        )
    return principal


def _unavailable(doing: str, exc: BaseException) -> JSONResponse:
    text = " ".join(str(exc).split()) or type(exc).__name__
    return JSONResponse(
        {"detail": f"Postgres or Redis failed while {doing} ({text}); nothing changed, try again"}, status_code=503, headers={"Retry-After": "1"}
    )


@router.get("/v1/settlements/dead-letters", response_model=DeadLetterList, responses={403: {"description": "not an operator without limits"}, **_UNAVAILABLE})
async def list_dead_letters(request: Request, _principal: Principal = Depends(_unlimited)) -> JSONResponse:
    """Runs whose settlement kept failing and was set aside, longest dead first: the reason, the
    tries, since when, and what each still holds. Until resolved, that stays held."""
    reconciler = request.app.state.rt
    try:
        async with reconciler.pool.acquire() as conn:
            found = await dead_letters.dead_letters(conn)
    except BACKEND_ERRORS as exc:
        return _unavailable("reading the dead-lettered settlements", exc)
    return JSONResponse({"dead_letters": found})


@router.post(
    "/v1/settlements/{run_id:path}/resolve",
    response_model=Resolved,
    responses={
        403: {"description": "not an operator without limits"},
        404: {"description": "no such run: no admission was ever decided for it"},
        409: {"description": "the run's settlement is not dead-lettered, or settling it again was refused as before; nothing changed"},
        **_UNAVAILABLE,
    },
)
async def resolve(
    body: ResolveIn, request: Request, run_id: str = Path(min_length=1, max_length=256), principal: Principal = Depends(_unlimited)
) -> JSONResponse:
    """Resolve the run's dead-lettered settlement: release what it holds, or settle it again. One
    ledger transaction (Postgres and Redis kept in line, as the reconciler's own settlements) that
    also forgets the dead letter and logs who did it and why in the admin log. A release leaves a
    running run its quota slot and pool token until its end is settled."""
    reconciler = request.app.state.rt
    try:
        async with reconciler.pool.acquire() as conn:
            await reconciler.bundles.refresh(conn)  # settled under the bundle active now, as the CLI did
        done = await dead_letters.resolve(reconciler.settler, run_id, release=body.action == RELEASE, actor=principal.name, reason=body.reason)
    except NotDeadLettered as exc:
        return JSONResponse({"detail": f"{exc}; nothing changed"}, status_code=409 if exc.known else 404)
    except StillFailing as exc:
        detail = f"{exc}; it stays dead-lettered and nothing changed: fix the cause first, or give back what it holds (action {RELEASE})"
        return JSONResponse({"detail": detail, "failure": exc.reason}, status_code=409)
    except BACKEND_ERRORS as exc:
        return _unavailable(f"resolving run {run_id!r}", exc)
    answer = {"run_id": run_id, "action": done.action, "actor": principal.name, "reason": body.reason, "changed": done.outcome.changed}
    return JSONResponse({**answer, "held": done.before, "holds": done.after})
