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
from opentelemetry.trace import SpanKind

from budgetgate import wire
from budgetgate.consumer import InboxConsumer, Poison, Route
from budgetgate.core.metering import Rejected
from budgetgate.outbox import OutboxRelay
from budgetgate.services.metering_ingest.api import BACKEND_ERRORS, Unavailable, router
from budgetgate.services.metering_ingest.ingest import Ingestor, Origin
from budgetgate.services.metering_ingest.metrics import MeteringMetrics
from budgetgate.services.metering_ingest.settings import MeteringSettings
from budgetgate.serving import add_operational_routes
from budgetgate.telemetry import Telemetry, extract_context, setup_telemetry
from budgetgate.topics import Topics, ensure_topics
from budgetgate.v1.metering_pb2 import MeteringSample

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    """What the service holds while it runs."""

    pool: asyncpg.Pool
    ingestor: Ingestor
    metrics: MeteringMetrics
    relay: OutboxRelay
    dlq_publisher: wire.Publisher
    consumer: InboxConsumer | None = None
    consuming: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)


def create_app(settings: MeteringSettings, *, telemetry: Telemetry | None = None) -> FastAPI:
    """The metering-ingest service for `settings`; connections open when the app starts."""
    telemetry = telemetry or setup_telemetry(service_name=settings.service_name, otlp_endpoint=settings.otlp_endpoint)
    metrics = MeteringMetrics(telemetry.meter("budgetgate.metering_ingest"))
    topics = Topics(settings.topic_prefix)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = await asyncpg.create_pool(settings.postgres_dsn, min_size=settings.pg_pool_min, max_size=settings.pg_pool_max, command_timeout=10)
        ingestor = Ingestor(max_skew=settings.max_future_skew, grace=settings.unknown_run_grace, counts=metrics)
        # Two producers: the relay's waits for Kafka on its own schedule, the consumer's
        # (dead letters) is started with the consumer.
        relay = OutboxRelay(pool=pool, publisher=wire.Publisher(settings.kafka_bootstrap, client_id=f"{settings.service_name}-relay"), topics=topics)
        rt = Runtime(pool, ingestor, metrics, relay, wire.Publisher(settings.kafka_bootstrap, client_id=f"{settings.service_name}-dlq"))
        app.state.rt = rt
        rt.tasks = [
            asyncio.create_task(relay.serve(), name="outbox-relay"),
            asyncio.create_task(_consume(rt, settings, topics), name="metering-consumer"),
            asyncio.create_task(_recheck_pending(rt, settings), name="pending-recheck"),
        ]
        try:
            yield
        finally:
            for task in rt.tasks:
                task.cancel()
            await asyncio.gather(*rt.tasks, return_exceptions=True)
            await relay.publisher.stop()
            await rt.dlq_publisher.stop()
            await pool.close()

    app = FastAPI(title="budgetgate metering-ingest", version="1", lifespan=lifespan)
    tracer = telemetry.tracer("budgetgate.metering_ingest")

    @app.middleware("http")
    async def limit_body(request: Request, call_next):  # type: ignore[no-untyped-def]
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > settings.max_body_bytes):
            return JSONResponse({"detail": f"request body larger than {settings.max_body_bytes} bytes"}, status_code=413)
        return await call_next(request)

    @app.middleware("http")
    async def trace_request(request: Request, call_next):  # type: ignore[no-untyped-def]
        # One server span per request, continuing the caller's W3C trace; usage records written
        # while it is current carry its context to Kafka.
        parent = extract_context(request.headers.items())
        with tracer.start_as_current_span(f"{request.method} {request.url.path}", context=parent, kind=SpanKind.SERVER) as span:
            response = await call_next(request)
            span.set_attribute("http.response.status_code", response.status_code)
            return response

    @app.exception_handler(Unavailable)
    async def unavailable(_request: Request, exc: Unavailable) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=503, headers={"Retry-After": "1"})

    app.include_router(router(max_batch=settings.max_batch_samples, metering_topic=topics.metering))

    add_operational_routes(app, telemetry=telemetry, readiness=lambda request: _readiness(request.app.state.rt))

    return app


async def _readiness(rt: Runtime) -> dict[str, str]:
    checks = {}
    try:
        await rt.pool.fetchval("SELECT 1")
        checks["postgres"] = "ok"
    except BACKEND_ERRORS as exc:
        checks["postgres"] = f"unreachable: {exc}"
    checks["kafka_consumer"] = "ok" if rt.consuming else "not consuming yet"
    return checks


def metering_route(ingestor: Ingestor, metrics: MeteringMetrics) -> Route:
    """How the consumer handles metering.samples.v1: a rejected sample is poison (to the DLQ)."""

    async def handle(conn: asyncpg.Connection, message: MeteringSample, record) -> None:  # type: ignore[no-untyped-def]
        origin = Origin(source="kafka", topic=record.topic, payload=record.value, headers=tuple(record.headers or ()), partition=record.partition, offset=record.offset)
        try:
            outcome = await ingestor.ingest(conn, message, origin)
        except Rejected as exc:
            raise Poison(str(exc)) from exc
        metrics.outcome(outcome, source="kafka")

    return Route(MeteringSample, handle)


async def _consume(rt: Runtime, settings: MeteringSettings, topics: Topics) -> None:
    """Consume metering.samples.v1 until cancelled, reconnecting whenever Kafka goes away."""
    publisher_started = False
    while True:
        consumer = InboxConsumer(
            name=settings.inbox_name, group=settings.consumer_group, bootstrap=settings.kafka_bootstrap, pool=rt.pool,
            publisher=rt.dlq_publisher, routes={topics.metering: metering_route(rt.ingestor, rt.metrics)},
            on_dead_letter=rt.metrics.dead_lettered,
        )  # fmt: skip
        try:
            await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix)
            if not publisher_started:
                await rt.dlq_publisher.start()
                publisher_started = True
            await consumer.start()
            rt.consumer, rt.consuming = consumer, True
            await consumer.run()
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - Kafka may come back; samples wait in their topic
            log.warning("metering consumer stopped (%s); reconnecting in 2s", exc)
            await asyncio.sleep(2)
        finally:
            rt.consuming = False
            await consumer.stop()


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
