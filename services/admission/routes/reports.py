"""Chargeback: `GET /v1/reports/chargeback?from=2026-11-01&to=2026-12-01&group_by=tenant&period=month`
(budgetgate.reports.chargeback), as JSON or, by `format=csv` or `Accept: text/csv`, as CSV. A
caller limited to namespaces or tenants sees only the runs within its limits, in the rows and the
total alike."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from budgetgate.edge.auth import Action, Principal, allow
from budgetgate.reports.chargeback import ReportError, ReportRequest, as_csv, chargeback
from budgetgate.reports.usage import UserSettings
from budgetgate.runtime.backends import BACKEND_ERRORS
from budgetgate.runtime.settings import CommonSettings
from budgetgate.services.admission.admitter import Unavailable

CSV = "text/csv"
CSV_EXAMPLE = (
    "period_start,tenant,gpu_hours,node_hours,cost,unpriced_gpu_hours,reserved_gpu_hours,reserved_cost,gpu_milli_hours,node_milli_hours,"
    "cost_micros,unpriced_gpu_milli_hours,reserved_gpu_milli_hours,reserved_cost_micros\n"
    "2026-11-01T00:00:00Z,vision,120.5,15.0,301.25,0.0,16.0,40.0,433800000,54000000,301250000,0,57600000,40000000\n"
)


def router(settings: CommonSettings) -> APIRouter:
    """GET /v1/reports/chargeback, by the tenant and user labels of `settings`."""
    tenant_label = settings.tenant_label
    user_label = getattr(settings, "user_label", None) or UserSettings().user_label
    api = APIRouter()

    @api.get(
        "/v1/reports/chargeback",
        tags=["reports"],
        responses={200: {"content": {CSV: {"schema": {"type": "string", "description": "the rows as CSV, a header line first"}, "example": CSV_EXAMPLE}}}},
    )
    async def chargeback_report(
        request: Request,
        start: Annotated[str, Query(alias="from", max_length=64)],
        to: Annotated[str, Query(max_length=64)],
        group_by: Annotated[list[str] | None, Query(max_length=200)] = None,
        period: Annotated[str, Query(max_length=16)] = "none",
        format: Annotated[str | None, Query(max_length=16)] = None,  # noqa: A002 - the parameter's public name
        principal: Principal = Depends(allow(Action.READ)),
    ) -> Response:
        """Metered GPU-hours, node-hours and cost over [from, to), and apart from them what is
        reserved but not yet metered, by the group keys and period asked."""
        if format not in (None, "json", "csv"):
            raise _invalid("format", f"unknown format {format!r}: json or csv")
        try:
            asked = ReportRequest.parse(start, to, group_by or ["tenant"], period)
        except ReportError as exc:
            raise _invalid(exc.field, str(exc)) from None
        rt = request.app.state.rt
        sees = None if principal.unscoped else principal.covers
        try:
            found = await chargeback(rt.pool, rt.policies.current, asked, tenant_label=tenant_label, user_label=user_label, sees=sees)
        except ReportError as exc:  # by account, without an account tree
            raise _invalid(exc.field, str(exc)) from None
        except BACKEND_ERRORS as exc:
            raise Unavailable(f"Postgres unavailable: {exc}") from exc
        if format == "csv" or (format is None and _wants_csv(request.headers.get("accept", ""))):
            return Response(as_csv(found), media_type=CSV)
        return JSONResponse(found)

    return api


def _wants_csv(accept: str) -> bool:
    """Whether the Accept header asks for CSV before JSON (a plain `*/*` gets JSON)."""
    kinds = [part.split(";")[0].strip().lower() for part in accept.split(",")]
    return CSV in kinds and ("application/json" not in kinds or kinds.index(CSV) < kinds.index("application/json"))


def _invalid(field: str, message: str) -> RequestValidationError:
    return RequestValidationError([{"loc": ["query", field], "msg": message, "type": "value_error"}])
