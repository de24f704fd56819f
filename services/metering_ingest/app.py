"""The metering-ingest service: create_app(settings) wires the Kafka consumer, HTTP ingest, the
outbox relay and the pending re-check to one Ingestor, in one process.

Each background task outlives outages of its dependency: the consumer reconnects to Kafka, the
relay keeps usage records in the outbox until Kafka is back, the re-check retries on its next
tick. Only Postgres is needed to accept a sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import asyncpg
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from faststream.kafka import KafkaBroker

from budgetgate.messaging.publisher import Publisher
from budgetgate.messaging.inbox import Inbox
from budgetgate.messaging.lag import ConsumerProgress
from budgetgate.messaging.outbox import OutboxRelay
from budgetgate.services.metering_ingest import consumers, lifecycle
from budgetgate.services.metering_ingest.api import Unavailable, router
from budgetgate.services.metering_ingest.ingest import Ingestor
from budgetgate.services.metering_ingest.metrics import MeteringMetrics
from budgetgate.services.metering_ingest.settings import MeteringSettings
from budgetgate.edge.auth import install_auth
from budgetgate.edge.bodies import BodyLimit
from budgetgate.edge.spans import ServerSpans
from budgetgate.messaging.subscriber import drain_pipelines, inbox_broker, start_consuming
from budgetgate.edge.serving import add_operational_routes, close_pool, close_within, postgres_check, stop_tasks
from budgetgate.runtime.telemetry import Telemetry, setup_telemetry
from budgetgate.contracts.topics import Topics
from budgetgate.messaging.topic_admin import ensure_topics

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """What the service holds while it runs."""

    pool: asyncpg.Pool
    ingestor: Ingestor
    metrics: MeteringMetrics
    relay: OutboxRelay
    dlq_publisher: Publisher
    inbox: Inbox
    progress: ConsumerProgress
    broker: KafkaBroker
    consuming: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


def create_app(settings: MeteringSettings, *, telemetry: Telemetry | None = None) -> FastAPI:
    """The metering-ingest service for `settings`; connections open when the app starts."""
    telemetry = telemetry or setup_telemetry(service_name=settings.service_name, otlp_endpoint=settings.otlp_endpoint)
    metrics = MeteringMetrics(telemetry.meter("budgetgate.metering_ingest"))
    topics = Topics(settings.topic_prefix)

    progress = ConsumerProgress(telemetry.meter("budgetgate.messaging.inbox"), name=settings.inbox_name)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = await asyncpg.create_pool(settings.postgres_dsn, min_size=settings.pg_pool_min, max_size=settings.pg_pool_max, command_timeout=10)
        ingestor = Ingestor(max_skew=settings.max_future_skew, grace=settings.unknown_run_grace, counts=metrics, tenant_label=settings.tenant_label)
        # Two producers: the relay's waits for Kafka on its own schedule, the consumer's
        # (dead letters) is started with the consumer.
        relay = OutboxRelay(
            pool=pool,
            publisher=Publisher(settings.kafka_bootstrap, client_id=f"{settings.service_name}-relay", access=settings.kafka_access),
            topics=topics,
            batch=settings.outbox_batch,
        )
        dlq_publisher = Publisher(settings.kafka_bootstrap, client_id=f"{settings.service_name}-dlq", access=settings.kafka_access)
        inbox = Inbox(
            name=settings.inbox_name,
            pool=pool,
            publisher=dlq_publisher,
            routes={topics.metering: consumers.metering_route(ingestor, metrics)},
            on_dead_letter=metrics.dead_lettered,
        )
        broker = inbox_broker(settings, consumers.router(settings=settings, topics=topics, runtime=lambda: app.state.rt))
        rt = Runtime(pool, ingestor, metrics, relay, dlq_publisher, inbox, progress, broker)
        app.state.rt = rt
        rt.tasks = [
            asyncio.create_task(relay.serve(), name="outbox-relay"),
            asyncio.create_task(_consume(rt, settings), name="metering-consumer"),
            asyncio.create_task(_recheck_pending(rt, settings), name="pending-recheck"),
        ]
        try:
            yield
        finally:
            await stop_tasks(rt.tasks)
            await close_within(broker.stop(), what="metering-ingest: Kafka consumer")
            await close_within(drain_pipelines(inbox), what="metering-ingest: polls in flight")
            await close_within(relay.publisher.stop(), what="metering-ingest: relay producer")
            await close_within(rt.dlq_publisher.stop(), what="metering-ingest: dead-letter producer")
            await close_pool(pool)

    app = FastAPI(title="budgetgate metering-ingest", version="1", lifespan=lifespan)
    tracer = telemetry.tracer("budgetgate.metering_ingest")

    # One server span per request, continuing the caller's W3C trace; usage records written
    # while it is current carry its context to Kafka.
    app.add_middleware(ServerSpans, tracer=tracer)

    @app.exception_handler(Unavailable)
    async def unavailable(_request: Request, exc: Unavailable) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    # Outermost of the app's own middleware: a body is bounded before anything reads it.
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    install_auth(app, settings)
    app.include_router(router(max_batch=settings.max_batch_samples, metering_topic=topics.metering))
    app.include_router(lifecycle.router(max_batch=settings.max_batch_events))

    add_operational_routes(app, telemetry=telemetry, readiness=lambda request: _readiness(request.app.state.rt), protect_metrics=settings.metrics_require_auth)

    return app


async def _readiness(rt: Runtime) -> dict[str, str]:
    checks = {"postgres": await postgres_check(rt.pool)}
    checks["kafka_consumer"] = "ok" if rt.consuming else "not consuming yet"
    return checks


async def _consume(rt: Runtime, settings: MeteringSettings) -> None:
    """Start the Kafka subscriber (and the dead-letter producer it needs), waiting for Kafka as
    long as it takes; once started, FastStream reconnects by itself. Samples wait in their topic."""

    async def topics_exist() -> None:
        await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix, access=settings.kafka_access)

    await start_consuming(rt.broker, rt.dlq_publisher, what="metering consumer", prepare=topics_exist)
    rt.consuming = True


async def _recheck_pending(rt: Runtime, settings: MeteringSettings) -> None:
    """Apply or expire pending samples every pending_recheck_seconds, outliving any outage."""
    while True:
        try:
            rt.metrics.pending = await rt.ingestor.recheck(rt.pool)
            rt.relay.wakeup.set()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - retried on the next tick
            log.warning("pending re-check failed: %s", exc)
        await asyncio.sleep(settings.pending_recheck_seconds)
