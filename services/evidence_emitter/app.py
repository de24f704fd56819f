"""The evidence-emitter: create_app(settings) wires the Kafka subscriber (decisions and
reconciliations into the delivery table, consumers.py) and the sender (delivery table to OpenLineage), and
serves /healthz, /readyz and /metrics.

Admission never waits for any of this: it only writes its outbox; a Marquez outage delays the
events here and nothing else.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from openlineage.client import OpenLineageClient
from opentelemetry.metrics import CallbackOptions, Observation

from faststream.kafka import KafkaBroker

from budgetgate.messaging.publisher import Publisher
from budgetgate.messaging.inbox import Inbox
from budgetgate.messaging.lag import ConsumerProgress
from budgetgate.edge.problems import install_problems
from budgetgate.edge.serving import close_pool, close_within, postgres_check, stop_tasks
from budgetgate.evidence import events
from budgetgate.services.evidence_emitter import consumers, transport
from budgetgate.services.evidence_emitter.handlers import EvidenceHandlers
from budgetgate.services.evidence_emitter.sender import Sender
from budgetgate.services.evidence_emitter.settings import EvidenceSettings
from budgetgate.messaging.subscriber import inbox_broker, start_consuming
from budgetgate.runtime.telemetry import Telemetry, setup_telemetry
from budgetgate.contracts.topics import Topics

CONSUMER_NAME = "evidence_emitter"


@dataclass
class Runtime:
    """What the service holds while it runs."""

    pool: asyncpg.Pool
    publisher: Publisher
    inbox: Inbox
    progress: ConsumerProgress
    broker: KafkaBroker
    sender: Sender
    client: OpenLineageClient
    consuming: bool = False


def create_app(settings: EvidenceSettings, *, client: OpenLineageClient | None = None, telemetry: Telemetry | None = None) -> FastAPI:
    """The evidence-emitter for `settings`; `client` overrides the OpenLineage configuration."""
    telemetry = telemetry or setup_telemetry(service_name=settings.service_name, otlp_endpoint=settings.otlp_endpoint)
    meter = telemetry.meter("budgetgate.evidence")
    stored = meter.create_counter("budgetgate_evidence_events", description="OpenLineage events stored for delivery, by stage and event type")
    topics = Topics(settings.topic_prefix)
    progress = ConsumerProgress(telemetry.meter("budgetgate.messaging.inbox"), name=CONSUMER_NAME)
    holder: dict[str, Runtime] = {}

    def gauge(read: Callable[[Runtime], float]) -> Callable[[CallbackOptions], list[Observation]]:
        return lambda _options: [Observation(read(holder["rt"]))] if "rt" in holder else []

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

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ol_client = client or transport.build_client(settings.evidence_file)
        pool = await asyncpg.create_pool(settings.postgres_dsn, min_size=settings.pg_pool_min, max_size=settings.pg_pool_max, command_timeout=10)
        publisher = Publisher(settings.kafka_bootstrap, client_id=settings.service_name, access=settings.kafka_access)
        handlers = EvidenceHandlers(producer=events.producer_uri(), on_stored=lambda stage, kind: stored.add(1, {"stage": stage, "event_type": kind}))
        inbox = Inbox(name=CONSUMER_NAME, pool=pool, publisher=publisher, routes=consumers.routes(topics, handlers))
        broker = inbox_broker(settings, consumers.router(settings=settings, topics=topics, runtime=lambda: app.state.rt))
        sender = Sender(
            pool=pool,
            send=lambda event: transport.send(ol_client, event),
            batch=settings.evidence_batch,
            initial_backoff=settings.evidence_initial_backoff_seconds,
            max_backoff=settings.evidence_max_backoff_seconds,
            idle_seconds=settings.evidence_idle_seconds,
            decision_wait=settings.evidence_decision_wait_seconds,
            server_error_limit=settings.evidence_server_error_limit,
        )
        rt = Runtime(pool, publisher, inbox, progress, broker, sender, ol_client)
        holder["rt"] = app.state.rt = rt
        tasks = [asyncio.create_task(_consume(rt), name="evidence-consumer"), asyncio.create_task(sender.run(), name="evidence-sender")]
        try:
            yield
        finally:
            # Bounded: a consumer stuck leaving its group, or a connection still held, is abandoned.
            await stop_tasks(tasks)
            await close_within(broker.stop(), what="evidence-emitter: Kafka consumer")
            await close_within(publisher.stop(), what="evidence-emitter: Kafka producer")
            with contextlib.suppress(Exception):
                await asyncio.to_thread(ol_client.close, 5.0)
            await close_pool(pool)
            holder.pop("rt", None)

    app = FastAPI(title="budgetgate evidence-emitter", version="1", lifespan=lifespan)
    install_problems(app)  # its own /readyz reports delivery too; errors are problem details all the same

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/readyz")
    async def readyz(request: Request) -> JSONResponse:
        rt: Runtime = request.app.state.rt
        checks: dict[str, Any] = {"postgres": await postgres_check(rt.pool)}
        checks["kafka_consumer"] = "ok" if rt.consuming else "not consuming yet"
        ok = all(v == "ok" for v in checks.values())
        # Delivery is reported, never required: a Marquez outage must not make the emitter unready.
        stats = rt.sender.stats
        delivery = {
            "transport": rt.client.transport.kind,
            "backlog": stats.backlog.pending,
            "oldest_undelivered_seconds": round(stats.backlog.oldest_seconds, 3),
            "last_error": stats.last_error,
        }
        return JSONResponse({"ready": ok, "checks": checks, "delivery": delivery}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(telemetry.metrics_text(), media_type=telemetry.metrics_content_type)

    return app


async def _consume(rt: Runtime) -> None:
    """Start the subscriber (and the producer its dead letters need), waiting for Kafka as long as
    it takes; once started, FastStream reconnects by itself. Decisions wait in their topics."""
    await start_consuming(rt.broker, rt.publisher, what="evidence consumer")
    rt.consuming = True
