"""Usage by user: `GET /v1/users/{user}/usage?days=90`. A user is the value of one label (`user`
unless BUDGETGATE_USER_LABEL says otherwise), read exactly as a tenant's usage is
(budgetgate.reports.usage.labelled_usage): budgets whose scope requires that label value, and the runs' reservations
and metered usage over the last `days` days."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from fastapi import Depends, FastAPI, Query, Request

from budgetgate.edge.auth import Action, Forbidden, Principal, allow
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.services.admission.admitter import Unavailable
from budgetgate.contracts.tenants import label_value_path
from budgetgate.reports.usage import UserSettings, labelled_usage
from budgetgate.runtime.settings import CommonSettings


def add_user_routes(app: FastAPI, settings: CommonSettings) -> None:
    """Register GET /v1/users/{user}/usage on the admission app."""
    label = getattr(settings, "user_label", None) or UserSettings().user_label

    @app.get("/v1/users/{user}/usage", tags=["usage"])
    async def user_usage(
        request: Request,
        user: str = label_value_path("user"),
        days: int = Query(90, ge=1, le=3660),
        principal: Principal = Depends(allow(Action.READ)),
    ) -> dict[str, Any]:
        if not principal.unscoped:
            # A user's runs may be in any tenant and namespace: a limited caller would see more than its limits.
            raise Forbidden(f"{principal.name!r} is limited to namespaces or tenants; a user's usage spans them all")
        rt = request.app.state.rt
        try:
            return await labelled_usage(rt.pool, rt.policies.current, who="user", label=label, value=user, days=days, now=datetime.now(UTC))
        except BACKEND_ERRORS as exc:
            raise Unavailable(f"Postgres unavailable: {exc}") from exc
