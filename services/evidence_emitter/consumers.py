"""The evidence-emitter's Kafka side, declared once (`subscription`): a batch subscriber on the
decisions and reconciliations topics. Each poll is stored by the inbox as OpenLineage events to
deliver (handlers.py) in one Postgres transaction, acknowledged only after that commit
(budgetgate.messaging.subscriber), and then wakes the sender."""

from __future__ import annotations

from typing import TYPE_CHECKING

from budgetgate.contracts.topics import Topics
from budgetgate.messaging.inbox import Route
from budgetgate.messaging.subscriber import Subscription
from budgetgate.services.evidence_emitter.settings import EvidenceSettings
from budgetgate.v1 import decisions_pb2, reconciliations_pb2

if TYPE_CHECKING:
    from budgetgate.services.evidence_emitter.service import EvidenceService


def subscription(settings: EvidenceSettings, topics: Topics) -> Subscription[EvidenceService]:
    """What the evidence-emitter consumes, in consumer group `settings.consumer_group`: each
    decision and each reconciliation stored as the events it makes."""
    return Subscription(
        routes={
            topics.decisions: lambda service: Route(decisions_pb2.Decision, service.handlers.decision),
            topics.reconciliations: lambda service: Route(reconciliations_pb2.Reconciliation, service.handlers.reconciliation),
        },
        # Set only once the poll committed: the sender will see its events.
        then=lambda service: service.sender.wakeup.set(),
        group_id=settings.consumer_group,
        group_timing=settings.kafka_group_timing,
        max_records=settings.consumer_max_records,
        title="evidence-emitter",
        description="Decisions (budgetgate.v1.Decision) and reconciliations (budgetgate.v1.Reconciliation) are stored as OpenLineage "
        "events and delivered to the configured transport (Marquez); poison goes to <topic>.dlq with the reason.",
    )
