"""The metering-ingest service (`MeteringService.build(settings, ...)`): the Kafka consumer, HTTP
ingest, the outbox relay and the pending re-check wired to one Ingestor, in one process.

Each background task outlives outages of its dependency: the consumer reconnects to Kafka, the
relay keeps usage records in the outbox until Kafka is back, the re-check retries on its next
tick. Only Postgres is needed to accept a sample. The runner (budgetgate.edge.runner) starts and
stops it with the app.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any

import asyncpg

from budgetgate.core.metering import FOLD
from budgetgate.contracts.topics import Topics
from budgetgate.edge.runner import Service
from budgetgate.edge.serving import close_pool, close_within, postgres_check
from budgetgate.ledger import partitions
from budgetgate.messaging.inbox import Inbox, prune_forever
from budgetgate.messaging.lag import ConsumerProgress
from budgetgate.messaging.outbox import OutboxRelay
from budgetgate.messaging.publisher import Publisher
from budgetgate.messaging.subscriber import drain_pipelines, inbox_broker, start_consuming
from budgetgate.messaging.topic_admin import ensure_topics
from budgetgate.services.metering_ingest import consumers
from budgetgate.services.metering_ingest.ingest import Ingestor
from budgetgate.services.metering_ingest.metrics import MeteringMetrics
from budgetgate.services.metering_ingest.settings import MeteringSettings

log = logging.getLogger(__name__)


class MeteringService(Service):
    """What the service holds while it runs."""

    def __init__(self, settings: MeteringSettings, pool: asyncpg.Pool, *, metrics: MeteringMetrics, progress: ConsumerProgress) -> None:
        self.settings = settings
        self.pool = pool
        self.metrics = metrics
        self.progress = progress
        topics = Topics(settings.topic_prefix)
        self.ingestor = Ingestor(
            max_skew=settings.max_future_skew,
            grace=settings.unknown_run_grace,
            counts=metrics,
            tenant_label=settings.tenant_label,
            usage_tolerance=settings.metering_usage_tolerance,
            usage_slack=settings.metering_usage_slack,
            fold=FOLD if settings.metering_fold else None,
        )
        # Two producers: the relay's waits for Kafka on its own schedule, the consumer's
        # (dead letters) is started with the consumer.
        self.relay = OutboxRelay(
            pool=pool,
            publisher=Publisher(settings.kafka_bootstrap, client_id=f"{settings.service_name}-relay", access=settings.kafka_access),
            topics=topics,
            batch=settings.outbox_batch,
        )
        self.outbox_relay = self.relay
        self.dlq_publisher = Publisher(settings.kafka_bootstrap, client_id=f"{settings.service_name}-dlq", access=settings.kafka_access)
        consumption = consumers.subscription(settings, topics)
        self.inbox = Inbox(
            name=settings.inbox_name, pool=pool, publisher=self.dlq_publisher, routes=consumption.inbox_routes(self), on_dead_letter=metrics.dead_lettered
        )
        self.broker = inbox_broker(settings, consumption.router(lambda: self))
        self.consuming = False
        self.tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def build(cls, settings: MeteringSettings, *, metrics: MeteringMetrics, progress: ConsumerProgress) -> MeteringService:
        pool = await asyncpg.create_pool(settings.postgres_dsn, min_size=settings.pg_pool_min, max_size=settings.pg_pool_max, command_timeout=10)
        return cls(settings, pool, metrics=metrics, progress=progress)

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {
            "metering-consumer": self._consume(),
            "pending-recheck": self._recheck_pending(),
            "partitions-ahead": partitions.keep_ahead(self.pool, ahead=self.settings.ledger_partitions_ahead_months),
            "inbox-prune": prune_forever(self.inbox, keep=self.settings.consumer_retention),
        }

    async def checks(self) -> dict[str, str]:
        checks = {"postgres": await postgres_check(self.pool)}
        checks["kafka_consumer"] = "ok" if self.consuming else "not consuming yet"
        return checks

    async def close(self) -> None:
        await close_within(self.broker.stop(), what="metering-ingest: Kafka consumer")
        await close_within(drain_pipelines(self.inbox), what="metering-ingest: polls in flight")
        await close_within(self.relay.publisher.stop(), what="metering-ingest: relay producer")
        await close_within(self.dlq_publisher.stop(), what="metering-ingest: dead-letter producer")
        await close_pool(self.pool)

    async def _consume(self) -> None:
        """Start the Kafka subscriber (and the dead-letter producer it needs), waiting for Kafka as
        long as it takes; once started, FastStream reconnects by itself. Samples wait in their topic."""
        settings = self.settings

        async def topics_exist() -> None:
            await ensure_topics(settings.kafka_bootstrap, prefix=settings.topic_prefix, access=settings.kafka_access)

        await start_consuming(self.broker, self.dlq_publisher, what="metering consumer", prepare=topics_exist)
        self.consuming = True

    async def _recheck_pending(self) -> None:
        """Apply or expire pending samples every pending_recheck_seconds, outliving any outage."""
        while True:
            try:
                self.metrics.pending = await self.ingestor.recheck(self.pool)
                self.relay.wakeup.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - retried on the next tick
                log.warning("pending re-check failed: %s", exc)
            await asyncio.sleep(self.settings.pending_recheck_seconds)
