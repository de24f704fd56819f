"""The admission HTTP service: create_app(settings) builds the adapters when the app starts and
includes the routers."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from opentelemetry.metrics import Counter, Histogram, Meter, Observation

from budgetgate.edge.auth import install_auth
from budgetgate.services.admission import bundles, kubernetes, quote_routes, routes, tenant_admin
from budgetgate.contracts import tenants as tenant_schemas
from budgetgate.services.admission.admitter import Unavailable
from budgetgate.decisions.deciding import InvalidSubmission
from budgetgate.services.admission.kubernetes import KubernetesWebhookSettings
from budgetgate.services.admission.fastpath import SubmissionFastPath
from budgetgate.edge.bodies import BodyLimit
from budgetgate.edge.spans import ServerSpans
from budgetgate.services.admission.resubmission import Conflict
from budgetgate.services.admission.runtime import build, readiness, start_background
from budgetgate.contracts.admission import OPERATIONS
from budgetgate.services.admission.settings import AdmissionSettings
from budgetgate.services.admission.budgets import add_budget_routes
from budgetgate.services.admission.tenants import add_tenant_routes
from budgetgate.services.admission.users import add_user_routes
from budgetgate.edge.serving import add_operational_routes, stop_tasks
from budgetgate.runtime.telemetry import Telemetry, setup_telemetry


@dataclass(frozen=True)
class Metrics:
    decisions: Counter
    latency: Histogram
    quotes: Counter

    @classmethod
    def create(cls, meter: Meter, app: FastAPI) -> Metrics:
        meter.create_observable_gauge(
            "budgetgate_reservations_held",
            callbacks=[lambda _options: [Observation(app.state.rt.held if hasattr(app.state, "rt") else 0)]],
            description="reservations held by admitted runs not yet reconciled",
        )
        meter.create_observable_counter(
            "budgetgate_redis_rebuilds",
            callbacks=[lambda _options: [Observation(app.state.rt.sync.rebuilds if hasattr(app.state, "rt") else 0)]],
            description="rebuilds of the Redis ledger from Postgres this instance made (Redis emptied, restored from an older snapshot, or invalidated)",
        )
        return cls(
            decisions=meter.create_counter("budgetgate_admission_decisions", description="admission answers by decision"),
            latency=meter.create_histogram("budgetgate_admission_latency", unit="s", description="time to answer a submission"),
            quotes=meter.create_counter("budgetgate_admission_quotes", description="quotes answered, by the decision quoted (never decisions)"),
        )

    def observe(self, answer: dict[str, Any], seconds: float) -> None:
        self.decisions.add(1, {"decision": answer["decision"], "replayed": "true" if answer["replayed"] else "false"})
        self.latency.record(seconds, {"decision": answer["decision"]})

    def observe_quote(self, answer: dict[str, Any], _seconds: float) -> None:
        self.quotes.add(1, {"decision": answer["decision"]})


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

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.rt = rt = await build(settings)
        start_background(rt)
        try:
            yield
        finally:
            await stop_tasks(rt.tasks)
            await rt.close()

    app = FastAPI(title="budgetgate admission", version="1", lifespan=lifespan, **_NO_NATIVE_TELEMETRY)
    app.state.metrics = Metrics.create(telemetry.meter("budgetgate.admission"), app)
    app.add_middleware(SubmissionFastPath)
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    app.add_middleware(ServerSpans, tracer=telemetry.tracer("budgetgate.admission"))
    _add_error_handlers(app)
    install_auth(app, settings)
    # Before routes.router: its GET /v1/admissions/{run_id:path} would take .../explain too.
    app.include_router(quote_routes.router)
    app.include_router(routes.router)
    app.include_router(bundles.router)
    app.include_router(tenant_admin.router)
    app.include_router(kubernetes.router(kubernetes_webhook or KubernetesWebhookSettings()))
    add_operational_routes(
        app,
        telemetry=telemetry,
        readiness=lambda request: readiness(request.app.state.rt),
        operations={**OPERATIONS, **quote_routes.OPERATIONS, **tenant_schemas.OPERATIONS},
        protect_metrics=settings.metrics_require_auth,
    )
    add_tenant_routes(app, settings)
    add_user_routes(app, settings)
    add_budget_routes(app, telemetry.meter("budgetgate.admission"))
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(Unavailable)
    async def unavailable(_request: Request, exc: Unavailable) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    @app.exception_handler(Conflict)
    async def conflict(_request: Request, exc: Conflict) -> JSONResponse:
        return JSONResponse(exc.problem(), status_code=409)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default echoes each bad input back, which fails on NaN and repeats
        # oversized values; the location and message name the problem well enough.
        detail: list[dict[str, Any]] = [{"loc": list(err["loc"]), "msg": err["msg"], "type": err["type"]} for err in exc.errors()]
        return JSONResponse({"detail": detail}, status_code=422)

    @app.exception_handler(InvalidSubmission)
    async def invalid(_request: Request, exc: InvalidSubmission) -> JSONResponse:
        loc = ["body", *exc.field.split(".")]
        return JSONResponse({"detail": [{"loc": loc, "msg": str(exc), "type": "value_error"}]}, status_code=422)
