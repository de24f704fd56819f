"""The admission HTTP service: create_app(settings) is the app the runner (budgetgate.edge.runner)
builds the service in (service.py), with the submission fast path, the routers (routes/) and the
operational routes."""

from __future__ import annotations

import inspect
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from budgetgate.contracts import budget_grants as grant_schemas
from budgetgate.contracts import tenants as tenant_schemas
from budgetgate.contracts.admission import OPERATIONS
from budgetgate.decisions.deciding import InvalidSubmission
from budgetgate.edge.auth import install_auth
from budgetgate.edge.bodies import BodyLimit
from budgetgate.edge.problems import validation_errors
from budgetgate.edge.runner import operational_routes, service_app
from budgetgate.edge.spans import ServerSpans
from budgetgate.runtime.telemetry import Telemetry, setup_telemetry
from budgetgate.services.admission import routes
from budgetgate.services.admission.admitter import Unavailable
from budgetgate.services.admission.fastpath import SubmissionFastPath
from budgetgate.services.admission.metrics import Metrics
from budgetgate.services.admission.resubmission import Archived, Conflict
from budgetgate.services.admission.routes.kubernetes import KubernetesWebhookSettings
from budgetgate.services.admission.service import AdmissionService
from budgetgate.services.admission.settings import AdmissionSettings

# FastAPI (0.165+) adds its own server and per-operation spans once an OpenTelemetry SDK is
# configured; ServerSpans already makes the one server span, and the operation spans cost more
# than a decision's Python work (see the profile in the commit adding this).
_NO_NATIVE_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False, "operation_spans": False}}
    if "telemetry" in inspect.signature(FastAPI.__init__).parameters
    else {}
)


def create_app(settings: AdmissionSettings, *, telemetry: Telemetry | None = None, kubernetes_webhook: KubernetesWebhookSettings | None = None) -> FastAPI:
    """The admission service for `settings` (and the Kubernetes webhook's, from BUDGETGATE_KUBERNETES_*
    unless given); connections open when the app starts."""
    telemetry = telemetry or setup_telemetry(service_name=settings.service_name, otlp_endpoint=settings.otlp_endpoint)
    app = service_app(title="budgetgate admission", build=lambda: AdmissionService.build(settings), **_NO_NATIVE_TELEMETRY)
    app.state.metrics = Metrics.create(
        telemetry.meter("budgetgate.admission"), lambda: getattr(app.state, "rt", None), stage_interval=settings.stage_timing_interval_seconds
    )
    app.add_middleware(SubmissionFastPath)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(ServerSpans, tracer=telemetry.tracer("budgetgate.admission"))
    _add_error_handlers(app)
    install_auth(app, settings)
    for router in routes.routers(settings, kubernetes_webhook=kubernetes_webhook or KubernetesWebhookSettings()):
        app.include_router(router)
    operational_routes(
        app,
        telemetry=telemetry,
        operations={**OPERATIONS, **routes.OPERATIONS, **tenant_schemas.OPERATIONS, **grant_schemas.OPERATIONS},
        protect_metrics=settings.metrics_require_auth,
    )
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(Unavailable)
    async def unavailable(_request: Request, exc: Unavailable) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(Conflict)
    async def conflict(_request: Request, exc: Conflict) -> JSONResponse:
        return JSONResponse(exc.problem(), status_code=409)

    @app.exception_handler(Archived)
    async def gone(_request: Request, exc: Archived) -> JSONResponse:
        return JSONResponse(exc.problem(), status_code=410)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"detail": validation_errors(exc)}, status_code=422)

    @app.exception_handler(InvalidSubmission)
    async def invalid(_request: Request, exc: InvalidSubmission) -> JSONResponse:
        loc = ["body", *exc.field.split(".")]
        return JSONResponse({"detail": [{"loc": loc, "msg": str(exc), "type": "value_error"}]}, status_code=422)
