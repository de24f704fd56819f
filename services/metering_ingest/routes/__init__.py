"""metering-ingest's HTTP routes, a module per what they serve: metering samples from exporters
that cannot speak Kafka (samples.py) and lifecycle events from platforms (lifecycle.py). Each
finds the running service as `request.app.state.rt`
(budgetgate.services.metering_ingest.service.MeteringService)."""

from __future__ import annotations

from fastapi import APIRouter

from budgetgate.contracts.topics import Topics
from budgetgate.services.metering_ingest.routes import lifecycle, samples
from budgetgate.services.metering_ingest.settings import MeteringSettings


def routers(settings: MeteringSettings) -> list[APIRouter]:
    """Every router of metering-ingest's API."""
    return [
        samples.router(max_batch=settings.max_batch_samples, metering_topic=Topics(settings.topic_prefix).metering),
        lifecycle.router(max_batch=settings.max_batch_events),
    ]
