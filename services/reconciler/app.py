"""The reconciler as a service: create_app(settings) is the app the runner (budgetgate.edge.runner)
starts the Reconciler in (service.py), its consumer, settle, upkeep and relay loops running until
the app stops, serving /healthz, /readyz (Postgres, Redis and its Kafka consumer), /metrics and the
operator's routes of the settlements it dead-lettered (routes.py)."""

from __future__ import annotations

from fastapi import FastAPI

from budgetgate.contracts.settlements import OPERATIONS
from budgetgate.edge.auth import install_auth
from budgetgate.edge.runner import operational_routes, service_app
from budgetgate.runtime.telemetry import Telemetry, setup_telemetry
from budgetgate.services.reconciler import routes
from budgetgate.services.reconciler.service import Reconciler
from budgetgate.services.reconciler.settings import ReconcilerSettings


def create_app(settings: ReconcilerSettings, *, telemetry: Telemetry | None = None) -> FastAPI:
    """The reconciler service for `settings`; connections open when the app starts."""
    telemetry = telemetry or setup_telemetry(service_name=settings.service_name, otlp_endpoint=settings.otlp_endpoint)
    app = service_app(title="budgetgate reconciler", build=lambda: Reconciler.create(settings, telemetry=telemetry))
    install_auth(app, settings)
    app.include_router(routes.router)
    operational_routes(app, telemetry=telemetry, operations=OPERATIONS, protect_metrics=settings.metrics_require_auth)
    return app
