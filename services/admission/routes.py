"""The admission API's routes: submissions and their decisions, usage by scope, token pools."""

from __future__ import annotations

import time
from datetime import UTC, datetime

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from budgetgate.backends import BACKEND_ERRORS
from budgetgate.services.admission.admitter import Unavailable
from budgetgate.services.admission.concurrency import NoSuchPool
from budgetgate.services.admission.runtime import Runtime
from budgetgate.services.admission.schemas import AdmissionRequest, AdmissionResponse, AllocationIn, Problem, ScopeUsage
from budgetgate.services.admission.usage import scope_usage

router = APIRouter()


def _rt(request: Request) -> Runtime:
    return request.app.state.rt


@router.post("/v1/admissions", response_model=AdmissionResponse, responses={409: {"model": Problem}, 422: {}, 503: {"model": Problem}})
async def submit(body: AdmissionRequest, request: Request) -> JSONResponse:
    started = time.perf_counter()
    rt = _rt(request)
    answer = await rt.admitter.admit(body)
    request.app.state.metrics.observe(answer, time.perf_counter() - started)
    rt.relay.wakeup.set()
    # Built here rather than by FastAPI: the body is already exactly the documented model,
    # and validating it again costs more than the decision's own Python work. (Submissions
    # normally take the plain ASGI path of fastpath.py; this route documents them.)
    return JSONResponse(answer)


@router.get("/v1/admissions/{run_id:path}", response_model=AdmissionResponse, responses={404: {"model": Problem}})
async def lookup(run_id: str, request: Request) -> dict | JSONResponse:
    try:
        answer = await _rt(request).admitter.lookup(run_id)
    except BACKEND_ERRORS as exc:
        raise Unavailable(f"Postgres unavailable: {exc}") from exc
    if answer is None:
        return JSONResponse({"detail": f"no decision for run {run_id!r}"}, status_code=404)
    return answer


@router.get("/v1/scopes/{scope_id}/usage", response_model=ScopeUsage, responses={404: {"model": Problem}})
async def usage(scope_id: str, request: Request) -> dict | JSONResponse:
    rt = _rt(request)
    if rt.policies.current is None:
        raise Unavailable("no policy bundle has been applied yet")
    try:
        result = await scope_usage(rt.pool, rt.policies.current, scope_id, datetime.now(UTC))
    except BACKEND_ERRORS as exc:
        raise Unavailable(f"Postgres unavailable: {exc}") from exc
    if result is None:
        return JSONResponse({"detail": f"no budget policy has scope {scope_id!r} in bundle {rt.policies.current.git_sha}"}, status_code=404)
    return result


@router.post("/v1/pools/{namespace}/allocations", responses={404: {"model": Problem}, 503: {"model": Problem}})
async def allocate(namespace: str, body: AllocationIn, request: Request) -> JSONResponse:
    """Granted | Exhausted | NamespaceQuotaExceeded, in `status`; idempotent per token."""
    try:
        return JSONResponse(await _rt(request).pools.allocate(namespace, body))
    except NoSuchPool as exc:
        return JSONResponse({"detail": str(exc)}, status_code=404)


@router.delete("/v1/pools/{namespace}/allocations/{token:path}", responses={503: {"model": Problem}})
async def deallocate(namespace: str, token: str, request: Request) -> JSONResponse:
    return JSONResponse(await _rt(request).pools.release(namespace, token))


@router.get("/v1/pools/{namespace}", responses={404: {"model": Problem}})
async def pool_status(namespace: str, request: Request) -> JSONResponse:
    found = await _rt(request).pools.status(namespace)
    if found is None:
        return JSONResponse({"detail": f"no ResourcePool declares namespace {namespace!r}"}, status_code=404)
    return JSONResponse(found)
