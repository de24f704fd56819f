"""The evidence-emitter HTTP service: create_app(settings) is the app the runner
(budgetgate.edge.runner) builds the service in (service.py), serving /healthz, /readyz (with
the delivery backlog beside the checks) and /metrics; it has no routes of its own."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
from openlineage.client import OpenLineageClient
from opentelemetry.metrics import CallbackOptions, Observation

from budgetgate.edge.runner import operational_routes, service_app
from budgetgate.messaging.lag import ConsumerProgress
from budgetgate.runtime.telemetry import Telemetry, setup_telemetry
from budgetgate.services.evidence_emitter.service import CONSUMER_NAME, EvidenceService
from budgetgate.services.evidence_emitter.settings import EvidenceSettings


def create_app(settings: EvidenceSettings, *, client: OpenLineageClient | None = None, telemetry: Telemetry | None = None) -> FastAPI:
    """The evidence-emitter for `settings`; `client` overrides the OpenLineage configuration."""
    telemetry = telemetry or setup_telemetry(service_name=settings.service_name, otlp_endpoint=settings.otlp_endpoint)
    meter = telemetry.meter("budgetgate.evidence")
    stored = meter.create_counter("budgetgate_evidence_events", description="OpenLineage events stored for delivery, by stage and event type")
    progress = ConsumerProgress(telemetry.meter("budgetgate.messaging.inbox"), name=CONSUMER_NAME)
    app = service_app(
        title="budgetgate evidence-emitter",
        build=lambda: EvidenceService.build(
            settings, client=client, progress=progress, on_stored=lambda stage, kind: stored.add(1, {"stage": stage, "event_type": kind})
        ),
    )

    def gauge(read: Callable[[EvidenceService], float]) -> Callable[[CallbackOptions], list[Observation]]:
        return lambda _options: [Observation(read(rt))] if (rt := getattr(app.state, "rt", None)) is not None else []

    meter.create_observable_gauge(
        "budgetgate_evidence_backlog", callbacks=[gauge(lambda rt: rt.sender.stats.backlog.pending)], description="events stored and not yet delivered"
    )
    meter.create_observable_gauge(
        "budgetgate_evidence_oldest_undelivered_age",
        unit="s",
        callbacks=[gauge(lambda rt: rt.sender.stats.backlog.oldest_seconds)],
        description="age of the oldest event not yet delivered",
    )
    meter.create_observable_counter(
        "budgetgate_evidence_delivered", callbacks=[gauge(lambda rt: rt.sender.stats.delivered)], description="events the receiver acknowledged"
    )
    meter.create_observable_counter(
        "budgetgate_evidence_dead_lettered",
        callbacks=[gauge(lambda rt: rt.sender.stats.dead_lettered)],
        description="events the receiver refused (400, 413, 422), kept in evidence_dead_letters",
    )
    meter.create_observable_counter(
        "budgetgate_evidence_delivery_failures", callbacks=[gauge(lambda rt: rt.sender.stats.failures)], description="sends that failed and will be retried"
    )
    operational_routes(app, telemetry=telemetry)
    return app
