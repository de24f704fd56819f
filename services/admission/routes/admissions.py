"""The admission API's routes: submissions and their decisions, usage by scope, token pools."""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any

import orjson
from fastapi import APIRouter, Depends, Path, Request
from fastapi.responses import JSONResponse

from budgetgate.edge.auth import Action, Forbidden, Principal, allow
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.ledger.queries import owned_by
from budgetgate.ledger.archive import archived_decision
from budgetgate.services.admission.access import archived_problem, require_budget_scope, require_submission
from budgetgate.services.admission.admitter import Unavailable
from budgetgate.decisions.concurrency import NoSuchPool
from budgetgate.services.admission.service import AdmissionService
from budgetgate.contracts.admission import (
    AdmissionRequest,
    AdmissionResponse,
    AdmissionStatus,
    AllocationIn,
    PoolNamespace,
    Problem,
    RunId,
    ScopeUsage,
    Token,
)
from budgetgate.reports.status import run_status
from budgetgate.reports.usage import scope_usage

sql = owned_by("budgetgate.services.admission")

router = APIRouter()


def _path(kind: object, description: str) -> Any:
    """A path parameter held to the rules its value has in a request body (`RunId`, ...): a value
    no submission could carry (a NUL, a space, too long) is a 422, not a query that fails."""
    constraints = kind.__metadata__[0]  # type: ignore[attr-defined]
    return Path(pattern=constraints.pattern, min_length=constraints.min_length, max_length=constraints.max_length, description=description)


RUN_ID = _path(RunId, "the run id (it may contain slashes)")
POOL = _path(PoolNamespace, "a declared pool, e.g. snowflake:wh-1")
TOKEN = _path(Token, "a pool token")


def _rt(request: Request) -> AdmissionService:
    return request.app.state.rt


@router.post("/v1/admissions", response_model=AdmissionResponse, responses={409: {"model": Problem}, 410: {"model": Problem}, 422: {}, 503: {"model": Problem}})
async def submit(body: AdmissionRequest, request: Request, principal: Principal = Depends(allow(Action.SUBMIT))) -> JSONResponse:
    started = time.perf_counter()
    rt = _rt(request)
    require_submission(principal, namespace=body.namespace, labels=body.labels, tenant_label=rt.settings.tenant_label)
    answer = await rt.admitter.admit(body)
    request.app.state.metrics.observe(answer, time.perf_counter() - started)
    # Built here rather than by FastAPI: the body is already exactly the documented model,
    # and validating it again costs more than the decision's own Python work. (Submissions
    # normally take the plain ASGI path of fastpath.py; this route documents them.)
    return JSONResponse(answer)


@router.get("/v1/admissions/{run_id:path}", response_model=AdmissionStatus, responses={404: {"model": Problem}, 410: {"model": Problem}})
async def lookup(request: Request, run_id: str = RUN_ID, principal: Principal = Depends(allow(Action.LOOKUP))) -> dict | JSONResponse:
    """The run's latest decision; for a DELAY or a quota rejection, `waiting` says what it waits
    for and how the limits that refused it stand now. 410 when it is archived."""
    rt = _rt(request)
    try:
        async with rt.pool.acquire() as conn:
            found = await run_status(conn, rt.policies.current, run_id, now=datetime.now(UTC))
            gone = await archived_decision(conn, run_id) if found is None else None
    except BACKEND_ERRORS as exc:
        raise Unavailable(f"Postgres unavailable: {exc}") from exc
    if gone is not None:
        return JSONResponse(archived_problem(principal, gone), status_code=410)
    if found is None:
        return JSONResponse({"detail": f"no decision for run {run_id!r}"}, status_code=404)
    answer, namespace, labels = found
    require_submission(principal, namespace=namespace, labels=labels, tenant_label=rt.settings.tenant_label)
    return answer


@router.get("/v1/scopes/{scope_id}/usage", response_model=ScopeUsage, responses={404: {"model": Problem}})
async def usage(scope_id: str, request: Request, principal: Principal = Depends(allow(Action.READ))) -> dict | JSONResponse:
    rt = _rt(request)
    if rt.policies.current is None:
        raise Unavailable("no policy bundle has been applied yet")
    matching = next((p.scope for p in rt.policies.current.policies if p.scope.scope_id == scope_id), None)
    if matching is not None:  # one scope id, one scope
        require_budget_scope(principal, matching, tenant_label=rt.settings.tenant_label)
    try:
        result = await scope_usage(rt.pool, rt.policies.current, scope_id, datetime.now(UTC))
    except BACKEND_ERRORS as exc:
        raise Unavailable(f"Postgres unavailable: {exc}") from exc
    if result is None:
        return JSONResponse({"detail": f"no budget policy has scope {scope_id!r} in bundle {rt.policies.current.git_sha}"}, status_code=404)
    return result


@router.post(
    "/v1/pools/{namespace}/allocations", responses={403: {"model": Problem}, 404: {"model": Problem}, 409: {"model": Problem}, 503: {"model": Problem}}
)
async def allocate(body: AllocationIn, request: Request, namespace: str = POOL, principal: Principal = Depends(allow(Action.ALLOCATE))) -> JSONResponse:
    """Granted | Exhausted | NamespaceQuotaExceeded, in `status`; idempotent per token (only
    the principal holding a token may renew it)."""
    try:
        return JSONResponse(await _rt(request).pools.allocate(namespace, body, principal=principal))
    except NoSuchPool as exc:
        return JSONResponse({"detail": str(exc)}, status_code=404)


@router.delete("/v1/pools/{namespace}/allocations/{token:path}", responses={403: {"model": Problem}, 503: {"model": Problem}})
async def deallocate(request: Request, namespace: str = POOL, token: str = TOKEN, principal: Principal = Depends(allow(Action.RELEASE))) -> JSONResponse:
    """A submitter releases the tokens it allocated; an operator any token."""
    return JSONResponse(await _rt(request).pools.release(namespace, token, principal=principal))


@router.get("/v1/pools/{namespace}", responses={404: {"model": Problem}})
async def pool_status(request: Request, namespace: str = POOL, principal: Principal = Depends(allow(Action.LOOKUP))) -> JSONResponse:
    """Quota, used and holders of a pool; a caller limited to namespaces or tenants sees only the
    holders within its limits (its own tokens, its runs'), while `used` counts every holder."""
    rt = _rt(request)
    found = await rt.pools.status(namespace)
    if found is None:
        return JSONResponse({"detail": f"no ResourcePool declares namespace {namespace!r}"}, status_code=404)
    if not principal.unscoped and found["holders"]:
        try:
            found["holders"] = await _visible_holders(rt, principal, namespace, found["holders"])
        except BACKEND_ERRORS as exc:
            raise Unavailable(f"Postgres unavailable: {exc}") from exc
    return JSONResponse(found)


async def _visible_holders(rt: AdmissionService, principal: Principal, namespace: str, holders: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The holders a limited principal may see: a submission's token (`run:<run id>`) when the
    run's namespace and tenant are within its limits, another token when it holds it itself.
    One lookup per holder: a pool holds a few dozen tokens, and only limited callers pay it."""
    visible = []
    async with rt.pool.acquire() as conn:
        for holder in holders:
            token = holder["token"]
            if token.startswith("run:"):
                row = await conn.fetchrow(sql("latest_decision"), token.removeprefix("run:"))
                if row is None:
                    continue
                labels = orjson.loads(row["labels"]) if isinstance(row["labels"], str) else dict(row["labels"])
                try:
                    require_submission(principal, namespace=row["namespace"], labels=labels, tenant_label=rt.settings.tenant_label)
                except Forbidden:
                    continue
            else:
                row = await conn.fetchrow(sql("pool_allocation_principal"), namespace, token)
                if row is None or row["principal"] != principal.name:
                    continue
            visible.append(holder)
    return visible
