"""The metering-ingest HTTP service: create_app(settings) is the app the runner
(budgetgate.edge.runner) builds the service in (service.py), with HTTP ingest of samples and
lifecycle events (routes/) and the operational routes."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from budgetgate.edge.auth import install_auth
from budgetgate.edge.bodies import BodyLimit
from budgetgate.edge.runner import operational_routes, service_app
from budgetgate.edge.spans import ServerSpans
from budgetgate.messaging.lag import ConsumerProgress
from budgetgate.runtime.telemetry import Telemetry, setup_telemetry
from budgetgate.services.metering_ingest import routes
from budgetgate.services.metering_ingest.metrics import MeteringMetrics
from budgetgate.services.metering_ingest.routes.samples import Unavailable
from budgetgate.services.metering_ingest.service import MeteringService
from budgetgate.services.metering_ingest.settings import MeteringSettings


def create_app(settings: MeteringSettings, *, telemetry: Telemetry | None = None) -> FastAPI:
    """The metering-ingest service for `settings`; connections open when the app starts."""
    telemetry = telemetry or setup_telemetry(service_name=settings.service_name, otlp_endpoint=settings.otlp_endpoint)
    metrics = MeteringMetrics(telemetry.meter("budgetgate.metering_ingest"))
    progress = ConsumerProgress(telemetry.meter("budgetgate.messaging.inbox"), name=settings.inbox_name)
    app = service_app(title="budgetgate metering-ingest", build=lambda: MeteringService.build(settings, metrics=metrics, progress=progress))

    # One server span per request, continuing the caller's W3C trace; usage records written
    # while it is current carry its context to Kafka.
    app.add_middleware(ServerSpans, tracer=telemetry.tracer("budgetgate.metering_ingest"))

    @app.exception_handler(Unavailable)
    async def unavailable(_request: Request, exc: Unavailable) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    # Outermost of the app's own middleware: a body is bounded before anything reads it.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    install_auth(app, settings)
    for router in routes.routers(settings):
        app.include_router(router)
    operational_routes(app, telemetry=telemetry, protect_metrics=settings.metrics_require_auth)
    return app
