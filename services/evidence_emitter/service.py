"""The evidence-emitter service (`EvidenceService.build(settings, ...)`): the Kafka subscriber
(decisions and reconciliations into the delivery table, consumers.py) and the sender (delivery
table to OpenLineage). The runner (budgetgate.edge.runner) starts and stops it with the app.

Admission never waits for any of this: it only writes its outbox; a Marquez outage delays the
events here and nothing else: delivery is reported in /readyz, never required.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any

import asyncpg
from openlineage.client import OpenLineageClient

from budgetgate.contracts.topics import Topics
from budgetgate.edge.runner import Service
from budgetgate.edge.serving import close_pool, close_within, postgres_check
from budgetgate.evidence import events
from budgetgate.messaging.inbox import Inbox, prune_forever
from budgetgate.messaging.lag import ConsumerProgress
from budgetgate.messaging.publisher import Publisher
from budgetgate.messaging.subscriber import inbox_broker, start_consuming
from budgetgate.services.evidence_emitter import consumers, transport
from budgetgate.services.evidence_emitter.handlers import EvidenceHandlers
from budgetgate.services.evidence_emitter.sender import Sender
from budgetgate.services.evidence_emitter.settings import EvidenceSettings

CONSUMER_NAME = "evidence_emitter"


class EvidenceService(Service):
    """What the service holds while it runs."""

    def __init__(
        self,
        settings: EvidenceSettings,
        pool: asyncpg.Pool,
        *,
        client: OpenLineageClient,
        progress: ConsumerProgress,
        on_stored: Callable[[str, str], None],
    ) -> None:
        self.settings = settings
        self.pool = pool
        self.client = client
        self.progress = progress
        self.publisher = Publisher(settings.kafka_bootstrap, client_id=settings.service_name, access=settings.kafka_access)
        self.handlers = EvidenceHandlers(producer=events.producer_uri(), on_stored=on_stored)
        consumption = consumers.subscription(settings, Topics(settings.topic_prefix))
        self.inbox = Inbox(name=CONSUMER_NAME, pool=pool, publisher=self.publisher, routes=consumption.inbox_routes(self))
        self.broker = inbox_broker(settings, consumption.router(lambda: self))
        self.sender = Sender(
            pool=pool,
            send=lambda event: transport.send(client, event),
            batch=settings.evidence_batch,
            initial_backoff=settings.evidence_initial_backoff_seconds,
            max_backoff=settings.evidence_max_backoff_seconds,
            idle_seconds=settings.evidence_idle_seconds,
            decision_wait=settings.evidence_decision_wait_seconds,
            server_error_limit=settings.evidence_server_error_limit,
        )
        self.consuming = False
        self.tasks: list[asyncio.Task[None]] = []

    @classmethod
    async def build(
        cls, settings: EvidenceSettings, *, client: OpenLineageClient | None, progress: ConsumerProgress, on_stored: Callable[[str, str], None]
    ) -> EvidenceService:
        """`client` overrides the OpenLineage configuration (settings.evidence_file)."""
        ol_client = client or transport.build_client(settings.evidence_file)
        pool = await asyncpg.create_pool(settings.postgres_dsn, min_size=settings.pg_pool_min, max_size=settings.pg_pool_max, command_timeout=10)
        return cls(settings, pool, client=ol_client, progress=progress, on_stored=on_stored)

    def loops(self) -> dict[str, Coroutine[Any, Any, None]]:
        return {
            "evidence-consumer": self._consume(),
            "evidence-sender": self.sender.run(),
            "inbox-prune": prune_forever(self.inbox, keep=self.settings.consumer_retention),
        }

    async def checks(self) -> dict[str, str]:
        checks = {"postgres": await postgres_check(self.pool)}
        checks["kafka_consumer"] = "ok" if self.consuming else "not consuming yet"
        return checks

    def details(self) -> dict[str, Any]:
        # Delivery is reported, never required: a Marquez outage must not make the emitter unready.
        stats = self.sender.stats
        return {
            "delivery": {
                "transport": self.client.transport.kind,
                "backlog": stats.backlog.pending,
                "oldest_undelivered_seconds": round(stats.backlog.oldest_seconds, 3),
                "last_error": stats.last_error,
            }
        }

    async def close(self) -> None:
        # Bounded: a consumer stuck leaving its group, or a connection still held, is abandoned.
        await close_within(self.broker.stop(), what="evidence-emitter: Kafka consumer")
        await close_within(self.publisher.stop(), what="evidence-emitter: Kafka producer")
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.client.close, 5.0)
        await close_pool(self.pool)

    async def _consume(self) -> None:
        """Start the subscriber (and the producer its dead letters need), waiting for Kafka as
        long as it takes; once started, FastStream reconnects by itself. Decisions wait in their topics."""
        await start_consuming(self.broker, self.publisher, what="evidence consumer")
        self.consuming = True
