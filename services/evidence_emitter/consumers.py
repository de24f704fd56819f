"""The evidence-emitter's Kafka side: one FastStream router with a batch subscriber on the
decisions and reconciliations topics. Each poll is stored by the inbox as OpenLineage events to
deliver (handlers.py) in one Postgres transaction, acknowledged only after that commit
(budgetgate.messaging.subscriber), and then wakes the sender."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from faststream.kafka import KafkaRouter

from budgetgate.messaging.inbox import Route
from budgetgate.services.evidence_emitter.settings import EvidenceSettings
from budgetgate.messaging.subscriber import subscribe_inbox
from budgetgate.contracts.topics import Topics
from budgetgate.v1 import decisions_pb2, reconciliations_pb2

if TYPE_CHECKING:
    from budgetgate.services.evidence_emitter.app import Runtime
    from budgetgate.services.evidence_emitter.handlers import EvidenceHandlers


def routes(topics: Topics, handlers: EvidenceHandlers) -> dict[str, Route]:
    """The inbox's routes: each decision and each reconciliation stored as the events it makes."""
    return {
        topics.decisions: Route(decisions_pb2.Decision, handlers.decision),
        topics.reconciliations: Route(reconciliations_pb2.Reconciliation, handlers.reconciliation),
    }


def router(*, settings: EvidenceSettings, topics: Topics, runtime: Callable[[], Runtime]) -> KafkaRouter:
    """The evidence-emitter's subscriber, in consumer group `settings.consumer_group`; `runtime()`
    gives what the service holds while it runs."""
    kafka = KafkaRouter()
    subscribe_inbox(
        kafka,
        topics.decisions,
        topics.reconciliations,
        runtime=runtime,
        # Set only once the poll committed: the sender will see its events.
        then=lambda rt: rt.sender.wakeup.set(),
        group_id=settings.consumer_group,
        max_records=settings.consumer_max_records,
        title="evidence-emitter",
        description="Decisions (budgetgate.v1.Decision) and reconciliations (budgetgate.v1.Reconciliation) are stored as OpenLineage "
        "events and delivered to the configured transport (Marquez); poison goes to <topic>.dlq with the reason.",
    )
    return kafka
