"""Every budget of the active bundle in its current window: `GET /v1/budgets`, and Prometheus
gauges per budget (`budgetgate_budget_used_ratio`, `budgetgate_budget_remaining`,
`budgetgate_budget_held`), refreshed periodically from Postgres so a scrape costs no query."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from opentelemetry.metrics import Meter, Observation

from budgetgate.core.policy import PolicyBundle
from budgetgate.edge.auth import Action, Principal, allow
from budgetgate.reports.budgets import list_budgets
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.services.admission.access import sees_budget

log = logging.getLogger(__name__)

REFRESH_SECONDS = 15.0


class BudgetBoard:
    """The last reading of every budget, for the gauges; `refresh` reads Postgres once."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.budgets: list[dict[str, Any]] = []

    def _runtime(self) -> tuple[Any, PolicyBundle | None]:
        rt = self.app.state.rt
        return rt.pool, rt.policies.current

    async def refresh(self, now: datetime | None = None) -> None:
        pool, bundle = self._runtime()
        self.budgets = [] if bundle is None else await list_budgets(pool, bundle, now or datetime.now(UTC))

    async def run(self, every: float) -> None:
        while True:
            try:
                await self.refresh()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the gauges keep their last reading until the next tick
                log.warning("budget gauges not refreshed: %s", exc)
            await asyncio.sleep(every)

    def observe(self, field: str) -> list[Observation]:
        observations = []
        for b in self.budgets:
            value = {"used_ratio": b["used_ratio"], "remaining": b["remaining"], "held": 1 if b["state"] == "held" else 0}[field]
            observations.append(Observation(value, {"policy_id": b["policy_id"], "scope_id": b["scope_id"], "unit": b["unit"]}))
        return observations


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


def add_budget_routes(app: FastAPI, meter: Meter, *, refresh_seconds: float = REFRESH_SECONDS) -> BudgetBoard:
    """`GET /v1/budgets`, and the budget gauges with their refresh task (started and stopped with
    the app). Needs `app.state.rt.pool` and `app.state.rt.policies`."""
    app.include_router(router)
    board = BudgetBoard(app)
    app.state.budget_board = board
    for name, field, description in (
        ("budgetgate_budget_used_ratio", "used_ratio", "share of the budget reserved or consumed in its current window"),
        ("budgetgate_budget_remaining", "remaining", "what is left of the budget in its current window, in hours or its currency"),
        ("budgetgate_budget_held", "held", "1 while a hold is in force on the budget, else 0"),
    ):
        meter.create_observable_gauge(name, callbacks=[lambda _options, f=field: board.observe(f)], description=description)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(app_: FastAPI) -> AsyncIterator[Any]:
        async with inner(app_) as state:
            task = asyncio.create_task(board.run(refresh_seconds), name="budget-gauges")
            try:
                yield state
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    app.router.lifespan_context = lifespan
    return board
