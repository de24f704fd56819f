"""The reconciler as a service: create_app(settings) builds the Reconciler (worker.py) when the app
starts, its consumer, settle, upkeep and relay loops running until the app stops, and serves
/healthz, /readyz (Postgres, Redis and its Kafka consumer), /metrics and the operator's routes
of the settlements it dead-lettered (routes.py)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request

from budgetgate.contracts.settlements import OPERATIONS
from budgetgate.edge.auth import install_auth
from budgetgate.edge.serving import add_operational_routes, postgres_check, redis_check
from budgetgate.runtime.telemetry import Telemetry, setup_telemetry
from budgetgate.services.reconciler import routes
from budgetgate.services.reconciler.settings import ReconcilerSettings
from budgetgate.services.reconciler.worker import Reconciler


def create_app(settings: ReconcilerSettings, *, telemetry: Telemetry | None = None) -> FastAPI:
    """The reconciler service for `settings`; connections open when the app starts."""
    telemetry = telemetry or setup_telemetry(service_name=settings.service_name, otlp_endpoint=settings.otlp_endpoint)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        reconciler = Reconciler(settings, telemetry=telemetry)
        await reconciler.start()
        app.state.rt = reconciler
        try:
            yield
        finally:
            # Bounded: a consumer stuck leaving its group, or a connection still held, is abandoned.
            await reconciler.stop()

    app = FastAPI(title="budgetgate reconciler", version="1", lifespan=lifespan)
    install_auth(app, settings)
    app.include_router(routes.router)
    add_operational_routes(app, telemetry=telemetry, readiness=readiness, operations=OPERATIONS, protect_metrics=settings.metrics_require_auth)
    return app


async def readiness(request: Request) -> dict[str, str]:
    """Ready once Postgres and Redis answer and its Kafka subscriber has started."""
    reconciler: Reconciler = request.app.state.rt
    checks = {"postgres": await postgres_check(reconciler.pool), "redis": await redis_check(reconciler.redis)}
    checks["kafka_consumer"] = "ok" if reconciler.consuming else "not consuming yet"
    return checks
